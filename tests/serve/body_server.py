"""A server in a process of its own for the body-limit test, whose memory is then the server's
alone: ``python -m tests.serve.body_server ENGINE_DIR PORT [whole]``. With ``whole`` it reads a
body whole before checking its size (the control: how the server read bodies before)."""

from __future__ import annotations

import sys

import uvicorn

from specexport.serve import app as app_module
from specexport.serve.config import ServeConfig


async def _whole(request):
    raw = await request.body()
    if len(raw) > app_module.MAX_BODY_BYTES:
        raise app_module.ApiError(413, "the request body is too large", code="body_too_large")
    return raw


def main(engine_dir: str, port: int, whole: bool) -> None:
    config = ServeConfig(engine_dir, "tiny", drafter="none", threads=1)
    app = app_module.create_app(config)
    if whole:
        app_module._read_body = _whole  # this process only: the control's reading
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:] == ["whole"])
