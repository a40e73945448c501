"""What the framework tests share: the corpus, a per-row fingerprint, the reference run, the checks.

A framework run records, per trained batch, the framework's epoch and one fingerprint per row
(a hash of the row's input token ids), and `len(loader)` at each epoch's start. The reference
is tierflow's own loop over the same dataset on the same rank (`endless=True`, no framework):
the batches an uninterrupted run must train, with their metas (sample ids and sample epochs).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BATCH, SEQ = 16, 128
VOCAB = 257  # bytes and EOS
"""Each rank's batch: 16 windows of 128 byte tokens (~108 batches an epoch on one rank)."""


def pack_corpus(root: Path, docs: int = 1500) -> str:
    """`docs` documents of random letters (no two windows alike), byte tokens, 2 shards."""
    import tierflow

    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "docs.jsonl", "w") as f:
        for i in range(docs):
            text = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(20 + (i * 37) % 250))
            f.write(json.dumps({"text": text}) + "\n")
    tierflow.pack([root / "docs.jsonl"], root / "ds", tokenizer="bytes", workers=1, target_shard_bytes=256 << 10)
    return str(root / "ds")


def fingerprint(ids: Any) -> list[str]:
    """One short hash per row of a (B, L) tensor or array of token ids."""
    rows = np.asarray(ids.detach().cpu().numpy() if hasattr(ids, "detach") else ids, dtype=np.int64)
    return [hashlib.blake2b(row.tobytes(), digest_size=8).hexdigest() for row in rows]


class Recorder:
    """Collects what a framework's step trained; `dump(path)` writes it as JSON."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []  # [framework epoch, [row fingerprints]]
        self.lens: list[Any] = []  # len(loader) at each epoch's first trained batch (None: no len)

    def step(self, epoch: int, ids: Any, loader: Any = None) -> None:
        """The step trains rows `ids` in the framework's `epoch`; `len(loader)` is read at the first
        batch of each epoch (a resumed epoch included: frameworks skip their epoch-start hooks then)."""
        if loader is not None and (not self.batches or self.batches[-1][0] != epoch):
            try:
                self.lens.append(len(loader))
            except TypeError:
                self.lens.append(None)
        self.batches.append([int(epoch), fingerprint(ids)])

    def dump(self, path: str | os.PathLike, **extra: Any) -> None:
        Path(path).write_text(json.dumps({"batches": self.batches, "lens": self.lens, **extra}))


def reference(
    data: str, batches: int, rank: int = 0, world: int = 1, nodes: bool = False, **options: Any
) -> list[dict[str, Any]]:
    """The first `batches` batches tierflow's own loop hands rank `rank` of `world` (one node, or
    with `nodes` each rank a node of its own): each {"rows": fingerprints, "ids": sample ids,
    "epochs": sample epochs, "epoch": batch epoch}."""
    from tierflow.loader import Loader, TieredDataset, WorldPosition
    from tierflow.loader.spec import specs_from

    options.setdefault("batch_size", BATCH)
    options.setdefault("seq_len", SEQ)
    position = WorldPosition(rank, world, 0, 1) if nodes else WorldPosition(0, 1, rank, world)
    batching, order = specs_from(options)
    ds = TieredDataset(data, batching, order, world=position, **options)
    out = []
    with Loader(ds, endless=True, return_meta=True) as loader:
        for batch, meta in loader:
            out.append(
                {
                    "rows": fingerprint(batch["input_ids"]),
                    "ids": meta.sample_ids.tolist(),
                    "epochs": meta.epochs.tolist(),
                    "epoch": meta.epoch,
                }
            )
            if len(out) == batches:
                break
    return out


def run(script: str, config: dict[str, Any], *, torchrun: int | None = None, timeout: float = 120) -> None:
    """Run tests/integrations/`script` with `config` (JSON) as its argument, in a new process (or
    `torchrun --nproc-per-node N`); fails with its output when it fails."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "TORCHDYNAMO_DISABLE": "1",
    }
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        env.pop(name, None)
    if torchrun:
        from tierflow.testing.distributed import free_port

        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={torchrun}",
            f"--master-port={free_port()}",
            str(HERE / script),
            json.dumps(config),
        ]
    else:
        command = [sys.executable, str(HERE / script), json.dumps(config)]
    env["PYTHONFAULTHANDLER"] = "1"  # a run killed for its time prints every thread's stack
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=config.get("cwd"),
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = _dump_and_kill(proc)
        raise AssertionError(
            f"{script} {config} still ran after {timeout} s; its threads' stacks:\n{out[-4000:]}\n{err[-24000:]}"
        ) from None
    if proc.returncode != 0:
        raise AssertionError(f"{script} {config} exited {proc.returncode}:\n{out[-4000:]}\n{err[-8000:]}")


def _dump_and_kill(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGABRT to the run and every process under it (faulthandler prints each one's threads;
    torchrun starts its workers in sessions of their own), then SIGKILL to what is left: a hung
    run says where it hung and leaves no process behind."""
    import signal

    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for sig in (signal.SIGABRT, signal.SIGKILL):
        for p in reversed(tree):  # the workers first: torchrun, aborted, would not wait on them
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=5)
    return proc.communicate()


def leave_process_group() -> None:
    """End a torchrun child cleanly, called once the training objects are out of scope: a gloo
    group left to the interpreter's exit can abort it ("terminate called without an active
    exception"), which reads as the framework failing.

    The DDP model is collected first, while the group is still registered. Its Reducer, freed
    after `destroy_process_group`, would hold the group's last reference, and the group's
    destructor then joins gloo's threads with the GIL held, which a thread still freeing a
    finished collective's tensors waits for: a hang at exit, 1 run in ~30 on 2 busy cores
    (torch issue 56297)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    from torch.nn.parallel import DistributedDataParallel

    alive = [o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)]
    assert not alive, f"a DDP model outlives the run ({len(alive)}): its Reducer would end the group"
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def load(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def check_uninterrupted(
    data: str,
    runs: list[dict[str, Any]],
    epochs: int | None = 2,
    nodes: bool = False,
    world: int | None = None,
    **options: Any,
) -> None:
    """Each rank trained exactly tierflow's own batches for its rank, in order; no (sample, epoch)
    twice across the ranks; with `epochs`, that many framework epochs, each as long as `len()` said
    at its start, and every sample of epoch 0 trained (where `runs` are all `world` ranks')."""
    world = world or len(runs)
    seen: dict[tuple[int, int], int] = {}
    first_epoch: set[int] = set()
    for rank, got in enumerate(runs):
        trained = [rows for _, rows in got["batches"]]
        ref = reference(data, len(trained), rank, world, nodes, **options)
        assert len(ref) == len(trained)
        for step, (rows, want) in enumerate(zip(trained, ref)):
            assert rows == want["rows"], f"rank {rank} step {step}: trained another batch than tierflow's own loop"
            for sample, epoch in zip(want["ids"], want["epochs"]):
                key = (epoch, sample)
                assert key not in seen, f"(sample {sample}, epoch {epoch}) trained twice (rank {rank} step {step})"
                seen[key] = rank
                if epoch == 0:
                    first_epoch.add(sample)
        if epochs is not None:
            per_epoch = [sum(1 for e, _ in got["batches"] if e == k) for k in range(epochs)]
            assert len(got["lens"]) >= epochs, got["lens"]
            assert per_epoch == got["lens"][:epochs], (
                f"rank {rank}: trained {per_epoch} batches, len() said {got['lens']}"
            )
            assert all(n > 0 for n in per_epoch), f"rank {rank}: an empty epoch {per_epoch}"
    if epochs is not None and epochs >= 2 and len(runs) == world:
        from tierflow.loader import TieredDataset
        from tierflow.loader.spec import specs_from

        options.setdefault("batch_size", BATCH)
        options.setdefault("seq_len", SEQ)
        batching, order = specs_from(options)
        total = TieredDataset(data, batching, order, **options).num_order_samples
        assert first_epoch == set(range(total)), f"{total - len(first_epoch)} samples of epoch 0 never trained"


def check_resumed(full: dict[str, Any], resumed: dict[str, Any], at: int) -> None:
    """The run resumed from the checkpoint after `at` batches trained exactly the rest of `full`."""
    want = [rows for _, rows in full["batches"][at:]]
    got = [rows for _, rows in resumed["batches"]]
    assert len(got) == len(want), f"resumed at {at}: trained {len(got)} batches, the uninterrupted run {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"resumed at {at}: batch {at + i} differs from the uninterrupted run's"
    tail = full["lens"][len(full["lens"]) - len(resumed["lens"]) :]
    assert resumed["lens"] == tail, f"resumed at {at}: len() said {resumed['lens']}, the uninterrupted run {tail}"
