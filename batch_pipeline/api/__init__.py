"""The HTTP API: thin routes (app.py, openai_routes.py) over services that check, store and describe jobs."""
