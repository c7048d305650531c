"""A local OpenAI-compatible HTTP server over the engine (no Qt).

`schema` checks request bodies, `wire` builds the OpenAI response objects, `jobs` is the
contract with whatever thread owns MLX (`EngineBackend`; `engine_thread` is the standalone
one, the app's `EngineWorker` the other), `api` is the Starlette app and `run` starts
uvicorn for `understudy serve`, the app and tests.
"""
