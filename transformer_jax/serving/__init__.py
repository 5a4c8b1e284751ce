"""`--mode serve`: an OpenAI-compatible HTTP server over a Predictor (docs/serving.md).

  batch_decoder.py  one compiled decode for a batch of rows with their own settings
  engine.py         the request queue and the thread that batches and decodes it
  texts.py          requests' prompts -> token ids; output ids -> texts, stops, stream pieces
  protocol.py       the request bodies (pydantic) and OpenAI's response and error objects
  app.py            the FastAPI routes
  server.py         loading the model, warming up, uvicorn, graceful shutdown
"""
