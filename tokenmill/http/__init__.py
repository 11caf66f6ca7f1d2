"""The HTTP toolkit `tokenmill serve` (serve/) and `tokenmill router` (router/) share: API-key and admin-key
checks (auth.py), request-body limits (body_limit.py), CORS (cors.py), OpenAI-shaped errors (errors.py),
cancelling a handler whose client left (disconnect.py), and the listening socket and draining uvicorn server
(server.py). It sits below both and imports nothing of them, nor of the engine: a router starts without it."""
