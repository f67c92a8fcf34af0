"""`specexport serve`: an OpenAI-compatible HTTP server over the batched decode loop.

    config.py      ServeConfig: everything a server (or a Ray Serve replica) is started with
    protocol.py    the OpenAI request bodies (pydantic) and error bodies
    engine_loop.py the engine thread: one BatchLoop stepping every request, a bounded queue
    metrics.py     Prometheus metrics, on a registry of the server's own
    app.py         create_app(config): the FastAPI app (routes, auth, errors, lifespan)
    ray_app.py     the same app behind Ray Serve, one engine loop per replica
"""
