"""`pack(..., engine="ray")`: the units of a pack run as Ray tasks, the shards are cut on the driver.

Why this shape: shard boundaries depend on the whole ordered batch stream, so the driver keeps
the local engine's ShardAssembler and feeds it the tasks' results in unit order; the output is
then byte-identical to a local pack (same dataset id, same shard files) whatever the cluster.
The expensive part (read, parse, `fn`, tokenise) runs on the cluster; compression and hashing
stay on the driver's threads, as they do locally.

A task's result travels through Ray's object store as Arrow IPC stream bytes (a worker on
another node shares no disk with the driver), and the driver writes it to its own scratch
directory, where the local engine's consumer maps and unlinks it. At most two tasks per worker
are in flight, so the driver's memory and scratch stay bounded as they do locally. A task whose
worker dies is retried by Ray (`max_retries`); its scratch is per attempt and its result is
taken once, in order, so a retry can neither duplicate nor drop a shard. Bad input
(PackInputError) is not retried: it fails the pack naming the file, as locally. A driver that
dies publishes nothing: the manifest is written last, after every shard.

Inputs must be readable at the same paths on every node (a shared file system), and tierflow
importable there (installed, or a `runtime_env`). A rerun after a killed driver resumes from the
units it had finished, as a local pack does (the packer's resume journal, pack._journal: the
engine only runs the units it is given); an s3:// pack starts over, skipping the uploads it finds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections import deque
from dataclasses import replace
from typing import Any
from collections.abc import Callable, Iterable

from tierflow.pack.unit_packer import PackConfig, UnitResult, pack_unit
from tierflow.pack.units import Unit
from tierflow.pack.tokenize import PackInputError

#: Ray retries a task whose worker process or node died this many times
TASK_RETRIES = 3


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PackInputError("engine='ray' needs Ray: pip install 'tierflow[ray]'") from None
    return ray


def pack_unit_to_buffers(unit: Unit, config: PackConfig, scratch_root: str) -> tuple[UnitResult, list[bytes]]:
    """One unit on a Ray worker: pack it into worker-local scratch, hand the Arrow streams back as bytes.

    The scratch directory is the unit's own and is emptied first, so a retry after a dead attempt
    starts clean and leaves nothing behind.
    """
    scratch = os.path.join(scratch_root, f"unit-{unit.index:09d}")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    try:
        result = pack_unit(unit, replace(config, tmp_dir=scratch))
        buffers = []
        for part in result.parts:
            with open(part, "rb") as f:
                buffers.append(f.read())
        result.parts = []
        return result, buffers
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class RayRunner:
    """The packer's unit runner on a Ray cluster (`address`: "auto", "ray://host:10001", or None).

    With no address and no Ray already initialised, `ray.init()` starts a local cluster (or joins
    the one RAY_ADDRESS names) and shuts it down when the pack ends. `workers` caps the tasks
    running at once; by default, every CPU of the cluster.
    """

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        self.address = address
        self.workers = workers

    def __call__(
        self, units: Iterable[Unit], config: PackConfig, workers: int, consume: Callable[[UnitResult], None]
    ) -> None:
        ray = _ray()
        started = not ray.is_initialized()
        if started:  # a dashboard is for the operator's cluster, not one a pack starts for itself
            ray.init(address=self.address, **({} if self.address else {"include_dashboard": False}))
        try:
            slots = self.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
            self._run(ray, units, config, slots, consume)
        finally:
            if started:
                ray.shutdown()

    def _run(
        self, ray: Any, units: Iterable[Unit], config: PackConfig, slots: int, consume: Callable[[UnitResult], None]
    ) -> None:
        task = ray.remote(max_retries=TASK_RETRIES, retry_exceptions=False)(pack_unit_to_buffers)
        scratch_root = os.path.join(tempfile.gettempdir(), f"tierflow-ray-{uuid.uuid4().hex[:12]}")
        config_ref = ray.put(config)
        window: deque = deque()
        try:
            for unit in units:
                window.append(task.remote(unit, config_ref, scratch_root))
                if len(window) >= 2 * slots:
                    consume(self._take(ray, window.popleft(), config))
            while window:
                consume(self._take(ray, window.popleft(), config))
        except BaseException:
            for ref in window:
                ray.cancel(ref, force=True)
            raise

    @staticmethod
    def _take(ray: Any, ref: Any, config: PackConfig) -> UnitResult:
        """A task's result, its streams written to the driver's scratch for the consumer to map."""
        try:
            result, buffers = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, PackInputError):
                raise cause from None
            raise
        for i, data in enumerate(buffers):
            path = os.path.join(config.tmp_dir, f"unit-{result.index:09d}-{i}.arrows")
            with open(path, "wb") as f:
                f.write(data)
            result.parts.append(path)
        return result
