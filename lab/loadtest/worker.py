"""A process hosting many simulated samplers of the rig, each a thread with its own clients,
key, spool and WAN link (its own Redis and S3 routes through `infra.fault_proxy`, with its
class's latency, jitter, bandwidth and resets; its groups' one-way transit delay is the
product's `sampler.delays.transit`).

Run by the rig as `python -m lab.loadtest.worker SPEC.json`. Every `STATS_EVERY_S` it
writes the spec's `stats_path` (atomically): its links' byte counts per sampler and each
sampler's own totals. SIGTERM: every sampler stops as a real one does (sends what it can,
releases its lease), the last stats are written, exit 0 (1 if a sampler failed).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from infra.fault_proxy import CONTROL_TIMEOUT_S, FaultProxy, FaultSpec, Route
from pipeline.config import HeteroConfig
from pipeline.config.commands import GpuClassConfig
from pipeline.config.delays import DelayDistributionConfig
from pipeline.models import load_tokenizer
from lab.loadtest.fleet import LockstepSampler, SimulatedSampler

STATS_EVERY_S = 1.0


def link_spec(gpu: GpuClassConfig) -> FaultSpec:
    return FaultSpec(latency_ms=gpu.latency_ms, jitter_ms=gpu.jitter_ms,
                     bandwidth_bytes_per_s=None if gpu.bandwidth_mbit_s is None else gpu.bandwidth_mbit_s * 125_000,
                     reset_probability_per_s=gpu.resets_per_hour / 3600)


def via(url: str, address: str) -> str:
    """`url` with its host:port replaced by `address` (credentials kept)."""
    parts = urlsplit(url)
    auth = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{auth}@{address}" if auth else address))


def sampler_config(cfg: HeteroConfig, gpu: GpuClassConfig, redis_address: str, s3_address: str) -> HeteroConfig:
    """The config one simulated sampler runs with: Redis and S3 through its own link, its
    groups held for its link's one-way latency."""
    transit = DelayDistributionConfig(kind="fixed", value=gpu.latency_ms / 1000) if gpu.latency_ms else \
        DelayDistributionConfig()
    return cfg.model_copy(update={
        "services": cfg.services.model_copy(update={"redis_url": via(cfg.services.redis_url, redis_address),
                                                    "s3_endpoint": via(cfg.services.s3_endpoint, s3_address)}),
        "sampler": cfg.sampler.model_copy(update={"delays": cfg.sampler.delays.model_copy(
            update={"transit": transit})})})


class Worker:
    def __init__(self, spec: dict):
        self.spec = spec
        self.cfg = HeteroConfig.model_validate(spec["config"])
        self.stop = threading.Event()
        self.samplers: dict[str, SimulatedSampler] = {}
        self.failed: dict[str, str] = {}
        self.threads: list[threading.Thread] = []

    def run(self) -> int:
        log = logging.getLogger("loadtest-worker")
        entries = self.spec["samplers"]
        redis_target, s3_target = urlsplit(self.cfg.services.redis_url), urlsplit(self.cfg.services.s3_endpoint)
        routes = []
        for e in entries:
            routes += [Route(f"redis-{e['id']}", 0, redis_target.hostname, redis_target.port),
                       Route(f"s3-{e['id']}", 0, s3_target.hostname, s3_target.port)]
        self.proxy = FaultProxy(routes, seed=int(self.spec.get("seed", 0))).start()
        tokenizer = load_tokenizer(Path(self.cfg.model.base))
        for e in entries:
            gpu = GpuClassConfig.model_validate(e["class"])
            self.proxy.set_spec(link_spec(gpu), routes=[f"redis-{e['id']}", f"s3-{e['id']}"])
            cfg = sampler_config(self.cfg, gpu, self.proxy.address(f"redis-{e['id']}"),
                                 self.proxy.address(f"s3-{e['id']}"))
            if self.spec["mode"] == "sync":
                sampler = LockstepSampler(cfg, e["id"], gpu, tokenizer, self.stop, quota=int(e["quota"]))
            else:
                sampler = SimulatedSampler(cfg, e["id"], gpu, tokenizer, self.stop)
            sampler.log.setLevel(logging.WARNING)  # hundreds of samplers: their warnings and errors only
            self.samplers[e["id"]] = sampler
            self.threads.append(threading.Thread(target=self._run_one, args=(e["id"], sampler), name=e["id"],
                                                 daemon=True))
        for t in self.threads:
            t.start()
        log.info("%d simulated samplers started", len(self.threads))
        while not self.stop.wait(STATS_EVERY_S):
            self.write_stats()
        for t in self.threads:
            t.join(timeout=60)
        self.write_stats(final=True)
        self.proxy.stop()
        if self.failed:
            log.error("%d sampler(s) failed: %s", len(self.failed), "; ".join(f"{k}: {v}" for k, v in
                                                                                self.failed.items()))
        return 1 if self.failed else 0

    def _run_one(self, sampler_id: str, sampler: SimulatedSampler) -> None:
        try:
            sampler.run()
        except Exception as e:  # noqa: BLE001 - counted and reported; the others go on
            self.failed[sampler_id] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            traceback.print_exc()

    def write_stats(self, final: bool = False) -> None:
        try:
            links = self.proxy.stats()
        except TimeoutError:  # the links' event loop is too busy to answer: the next write will do
            logging.getLogger("loadtest-worker").warning("the links did not report their counts within %.0fs",
                                                         CONTROL_TIMEOUT_S)
            return
        samplers = {}
        for sampler_id, s in self.samplers.items():
            outbox = getattr(s, "outbox", None)
            policy = getattr(s, "policy", None)
            samplers[sampler_id] = {
                **(s.totals() if outbox is not None and policy is not None else {}),
                "generating_s": policy.engine.generating_s if policy is not None else 0.0,
                "loading_weights_s": policy.engine.loading_s if policy is not None else 0.0,
                "redis_commands": dict(s.redis_commands),
                "policy_version": policy.version if policy is not None else None,
                "redis_bytes": links[f"redis-{sampler_id}"]["bytes_up"] + links[f"redis-{sampler_id}"]["bytes_down"],
                "s3_bytes": links[f"s3-{sampler_id}"]["bytes_up"] + links[f"s3-{sampler_id}"]["bytes_down"],
                "connections_reset": (links[f"redis-{sampler_id}"]["connections_reset"]
                                      + links[f"s3-{sampler_id}"]["connections_reset"]),
            }
        path = Path(self.spec["stats_path"])
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"time": time.time(), "final": final, "samplers": samplers,
                                   "failed": self.failed, "pid": os.getpid()}))
        tmp.replace(path)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("infra.fault_proxy").setLevel(logging.ERROR)  # its resets are counted in its stats
    worker = Worker(json.loads(Path(argv[0]).read_text()))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop.set())
    return worker.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
