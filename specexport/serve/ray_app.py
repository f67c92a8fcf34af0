"""`specexport serve --ray`: the same FastAPI app behind Ray Serve, one engine loop per replica.

Each replica is a Ray actor that builds ``create_app(config)`` and runs its lifespan (Ray Serve
runs an ingress app's startup and shutdown events in the replica), so each has its own loading
thread and engine thread. Ray Serve's HTTP proxy routes requests (streamed SSE included) to the
replicas, and its autoscaler adds replicas while their batches are full: no load balancer here.

Three ways in:
    specexport serve ENGINE_DIR --ray --replicas N [--autoscale MIN:MAX] [--ray-address ADDR]
        -> ``run``: starts (or joins) Ray, serves until Ctrl-C / SIGTERM, then shuts down
    serve run specexport.serve.ray_app:app_builder engine_dir=DIR replicas=2
        -> ``app_builder``: Ray Serve's application builder (also for `serve deploy` configs)
    deployment(config, replicas=...) -> a bound application for serve.run in your own code

Ray is the ``ray`` extra (pip install 'specexport[ray]'); it is imported only when used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import threading
from typing import Any

from specexport.errors import BadInput, SpecexportError, missing_extra
from specexport.serve.config import ServeConfig, refuse_recurrent_backend

APP_NAME = "specexport"
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a single-machine Ray on 127.0.0.1
LOAD_TIMEOUT_S = 1800.0  # a replica's engine must load within this (its first health check waits)


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise missing_extra("ray[serve]", "ray") from None
    return ray, serve


class SpecexportReplica:
    """One Ray Serve replica: ``create_app(config)`` with its own engine thread.

    Wrapped by ``serve.ingress()`` in ``deployment`` (late-bound: Ray calls
    ``__serve_build_asgi_app__`` in the replica, then runs the app's lifespan there; the
    replica's destructor runs its shutdown, which stops the engine thread)."""

    def __init__(self, config: ServeConfig):
        self.config = config

    def __serve_build_asgi_app__(self):
        from specexport.serve.app import create_app

        return create_app(self.config)

    async def check_health(self) -> None:
        """Ray Serve's health check. The first one (part of the replica's start) waits for the
        engine to load, so the proxy routes to a replica only once it can decode; later ones
        fail when the engine thread has stopped, and Ray Serve replaces the replica."""
        state = self.app.state.server  # ServerState (app.py)
        if not state.loaded.is_set():
            loaded = await asyncio.to_thread(state.loaded.wait, LOAD_TIMEOUT_S)
            if not loaded:
                raise RuntimeError(f"{self.config.engine_dir}: the engine did not load in {LOAD_TIMEOUT_S:.0f} s")
        try:
            state.ready_engine()
        except Exception as err:  # ApiError: failed to load, or the engine thread stopped
            raise RuntimeError(f"{self.config.engine_dir}: {err}") from None


def _driver_manifest(config: ServeConfig):
    """The engine directory's Manifest as this driver reads it; None when it cannot (the
    replicas, which load it, report why)."""
    from specexport.contract import Manifest

    try:
        return Manifest.load(config.engine_dir)
    except Exception:  # noqa: BLE001 - e.g. a driver off the cluster's shared filesystem
        return None


def served_batch(config: ServeConfig) -> int | None:
    """The rows one replica decodes per round (as the batched loop picks them: the largest batch
    size built, at most max_batch); None when the engine directory cannot be read here."""
    manifest = _driver_manifest(config)
    if manifest is None:
        return config.max_batch
    built = manifest.batch_sizes("target")
    return max([b for b in built if config.max_batch is None or b <= config.max_batch] or [1])


def autoscaling_config(config: ServeConfig, settings: dict, replicas: int | None = None) -> dict:
    """Ray Serve's autoscaling_config: ``settings`` (min_replicas, max_replicas, or any of Ray's
    keys) over the defaults: aim at one full batch of requests per replica, so a replica is added
    when batches fill; start with ``replicas`` (kept within min..max)."""
    batch = served_batch(config) or 1
    merged = {"min_replicas": 1, "max_replicas": max(1, replicas or 1), "target_ongoing_requests": batch,
              **settings}
    if replicas is not None and "initial_replicas" not in settings:
        merged["initial_replicas"] = min(max(replicas, merged["min_replicas"], 1), merged["max_replicas"])
    if not 0 <= merged["min_replicas"] <= merged["max_replicas"] or merged["max_replicas"] < 1:
        raise BadInput(f"autoscaling: need 0 <= min_replicas <= max_replicas and max_replicas >= 1 "
                       f"(got {merged['min_replicas']}:{merged['max_replicas']})")
    return merged


def deployment(config: ServeConfig, *, replicas: int | None = None, autoscaling: dict | None = None,
               num_cpus_per_replica: float = 1.0, max_replicas_per_node: int | None = None,
               name: str = APP_NAME):
    """The bound Ray Serve application (``.bind()``): ``replicas`` fixed replicas (default 1),
    or, with ``autoscaling`` ({"min_replicas": a, "max_replicas": b} and any of Ray's
    autoscaling_config keys), between a and b replicas, starting with ``replicas``. Each
    replica reserves ``num_cpus_per_replica`` CPUs (match it to config.threads) and admits
    max_batch + max_waiting requests at once; Ray Serve queues the rest."""
    manifest = _driver_manifest(config)
    if manifest is not None:  # refused here, not by every replica in turn
        refuse_recurrent_backend(manifest, config.engine_dir, config.backend)
    _, serve = _ray()
    if replicas is not None and replicas < 1:
        raise BadInput(f"replicas: need at least 1 (got {replicas})")
    batch = served_batch(config) or 1
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": {"num_cpus": num_cpus_per_replica},
        "max_ongoing_requests": batch + config.max_waiting,
        "max_constructor_retry_count": 3,  # a directory that fails to load fails the same way again
    }
    if autoscaling is not None:
        options["autoscaling_config"] = autoscaling_config(config, autoscaling, replicas)
    else:
        options["num_replicas"] = replicas or 1
    if max_replicas_per_node is not None:
        options["max_replicas_per_node"] = max_replicas_per_node
    ingress = serve.ingress()(SpecexportReplica)
    return serve.deployment(ingress, **options).bind(config)


# -- serve run specexport.serve.ray_app:app_builder engine_dir=... --------------------------

_BUILDER_KEYS = {"replicas", "autoscale", "num_cpus_per_replica", "max_replicas_per_node"}


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise BadInput(f"{key}: '{value}' is not true or false")


def app_builder(args: dict[str, Any]):
    """Ray Serve's application builder, for `serve run` and `serve deploy` configs:

        serve run specexport.serve.ray_app:app_builder engine_dir=/models/smollm2 replicas=2

    Keys: ServeConfig's fields (engine_dir, model_name, drafter, max_batch, max_waiting, threads,
    api_key, schedule, per_sequence, adaptive, special_tokens_in_content), replicas, autoscale=MIN:MAX,
    num_cpus_per_replica, max_replicas_per_node. Values arrive as strings from the command line."""
    args = dict(args)
    fields = {f.name: f for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(args) - set(fields) - _BUILDER_KEYS)
    if unknown:
        raise BadInput(f"app_builder: unknown argument(s) {', '.join(unknown)}; "
                       f"known: {', '.join([*fields, *sorted(_BUILDER_KEYS)])}")
    if not args.get("engine_dir"):
        raise BadInput("app_builder: engine_dir=DIR is required")
    values: dict[str, Any] = {}
    for key, raw in args.items():
        if key not in fields:
            continue
        kind = str(fields[key].type)
        if raw is None or (isinstance(raw, str) and raw.lower() in ("", "none", "null") and "None" in kind):
            values[key] = None
        elif kind.startswith("bool"):
            values[key] = _parse_bool(key, raw)
        elif kind.startswith("int"):
            values[key] = _int(key, raw)
        else:
            values[key] = str(raw)
    config = ServeConfig(**values)
    autoscale = None
    if args.get("autoscale"):
        low, _, high = str(args["autoscale"]).partition(":")
        autoscale = {"min_replicas": _int("autoscale", low), "max_replicas": _int("autoscale", high)}
    return deployment(
        config,
        replicas=_int("replicas", args["replicas"]) if args.get("replicas") else None,
        autoscaling=autoscale,
        num_cpus_per_replica=float(args.get("num_cpus_per_replica", 1.0)),
        max_replicas_per_node=_int("max_replicas_per_node", args["max_replicas_per_node"])
        if args.get("max_replicas_per_node") else None,
    )


def _int(key: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadInput(f"{key}: '{value}' is not an integer") from None


# -- specexport serve ENGINE_DIR --ray ----------------------------------------------------------


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _failure(serve, name: str) -> str | None:
    """The last line of what Ray Serve says about the application's failed deployment."""
    try:
        app = serve.status().applications[name]
        messages = [d.message for d in app.deployments.values() if d.message] or [app.message]
    except Exception:  # noqa: BLE001 - only a better message is at stake
        return None
    lines = [line.strip() for line in "\n".join(messages).splitlines() if line.strip()]
    return lines[-1].removeprefix("RuntimeError: ") if lines else None


def run(config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000, replicas: int | None = 2,
        autoscaling: dict | None = None, address: str | None = None, num_cpus: float | None = None,
        num_cpus_per_replica: float = 1.0, max_replicas_per_node: int | None = None,
        name: str = APP_NAME, stop: threading.Event | None = None) -> None:
    """Serve ``config`` through Ray Serve until Ctrl-C or SIGTERM (or ``stop`` is set: the
    way to end it when it runs outside the main thread), then shut down.

    ``address``: an existing Ray cluster ("auto", "HOST:6379", "ray://..."); None starts a
    local Ray instance on 127.0.0.1 with ``num_cpus`` CPUs (default: all). Serve's HTTP proxy
    listens on ``host``:``port`` (on every node of a cluster). On a cluster this application is
    deleted at exit (and Serve shut down if nothing else runs on it); a local instance is
    stopped entirely."""
    local = address is None
    if local:
        # Ray maps 127.0.0.1 to the machine's network address unless clusters are off: a local
        # instance then uses 127.0.0.1 as its node address and binds every port there. Read
        # when ray is imported (the CLI has not imported it yet).
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    ray, serve = _ray()
    app = deployment(config, replicas=replicas, autoscaling=autoscaling, num_cpus_per_replica=num_cpus_per_replica,
                     max_replicas_per_node=max_replicas_per_node, name=name)
    stop = stop or threading.Event()
    starting = True

    def on_signal(signum, frame):
        stop.set()
        if starting:  # serve.run is waiting for the replicas: interrupt it
            raise KeyboardInterrupt

    previous: dict[int, Any] = {}
    try:
        if local:
            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus)
        else:
            ray.init(address=address)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, on_signal)
        if local:
            cpus = ray.cluster_resources().get("CPU", 0.0)
            first = autoscaling_config(config, autoscaling, replicas)["initial_replicas"] if autoscaling else replicas or 1
            if first * num_cpus_per_replica > cpus:
                raise BadInput(f"{first} replicas x {num_cpus_per_replica} CPUs do not fit this machine's "
                               f"{cpus:g} CPUs: ask for fewer replicas, or join a cluster with --ray-address")
        serve.start(http_options={"host": host, "port": port})
        _say(f"starting '{config.served_name}' on Ray Serve ({'local' if local else address}); "
             "waiting for the replicas to load")
        try:
            serve.run(app, name=name, route_prefix="/")
        except RuntimeError as err:  # a replica failed to start (its error is in the log above)
            raise SpecexportError(f"Ray Serve could not start '{name}': {_failure(serve, name) or err}") from None
        scale = (f"{autoscaling.get('min_replicas', 1)}-{autoscaling.get('max_replicas')} replicas (autoscaled)"
                 if autoscaling else f"{replicas or 1} replicas")
        _say(f"serving '{config.served_name}' on http://{host}:{port}/v1 through Ray Serve, {scale}; "
             "Ctrl-C stops")
        starting = False
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        starting = False
        _say("stopping: Ray Serve shuts the replicas down")
        try:
            if ray.is_initialized():
                if local:
                    serve.shutdown()
                else:
                    serve.delete(name)
                    if not serve.status().applications:
                        serve.shutdown()
        finally:
            ray.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
