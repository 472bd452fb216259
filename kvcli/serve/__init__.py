"""`kvcli serve`: an OpenAI-compatible HTTP server (app.py) over parallel slots (engine.py; a step's slots as
one cache: slots.py)."""
