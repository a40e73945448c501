"""What the benchmarks share, so each states its figures the same way: the "median (min-max)" cell,
rounds that alternate the order of what they compare, and the S3 rig (moto's S3 server behind a
metering, throttleable proxy, each in its own process, so neither's CPU is counted here).

Nothing of tierflow is imported until the rig starts: the benchmarks that time imports or measure
a child's memory (startup, pack) import this module in their children too."""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from tierflow.testing import MotoS3Server, ProxyProcess

T = TypeVar("T")


def summary(values: Iterable[float | None]) -> tuple[float, float, float] | None:
    """(median, min, max) of the values that are not None; None when there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return statistics.median(present), min(present), max(present)


def spread(values: Iterable[float | None], fmt: str = ".1f", scale: float = 1.0) -> str:
    """The median and the spread of the rounds, "12.3 (11.0-14.1)", so the reader sees how far rounds
    disagree; one figure when they agree (or there is one round), "-" when there is none."""
    found = summary(values)
    if found is None:
        return "-"
    mid, low, high = (format(v * scale, fmt) for v in found)
    return mid if found[1] == found[2] else f"{mid} ({low}-{high})"


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and every process under it, now, the ones that
    have ended and been reaped included: a DataLoader joins its workers at the end of an epoch, and
    their CPU then moves into their parent's `children_*` times (counting only the living ones lost
    every peer's worker CPU, while the Loader's pool, still alive, was counted whole)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def round_order(round_number: int, items: Sequence[T]) -> Sequence[T]:
    """`items` in the order round `round_number` measures them: reversed every other round, so a
    drift in the machine's load (or a cache warmed by the one before) favours none of them."""
    return items if round_number % 2 == 0 else items[::-1]


def alternating(rounds: int, items: Sequence[T]) -> Iterator[tuple[int, T]]:
    """(round, item) for every item of every round, in `round_order`."""
    for round_number in range(rounds):
        for item in round_order(round_number, items):
            yield round_number, item


@dataclass
class S3Rig:
    """A moto S3 server, a `ProxyProcess` in front of it (count, throttle: `proxy.url`), one bucket."""

    server: MotoS3Server
    proxy: ProxyProcess
    bucket: str

    def upload(self, local: str | os.PathLike[str], prefix: str) -> str:
        """Upload the packed dataset at `local` under `prefix`; returns its s3:// URL."""
        from tierflow.storage.remote import upload_dataset

        url = f"s3://{self.bucket}/{prefix}"
        upload_dataset(Path(local), url, endpoint_url=self.server.endpoint_url)
        return url


@contextmanager
def s3_rig(bucket: str) -> Iterator[S3Rig]:
    """The rig with fake credentials in this process's environment (moto accepts any)."""
    from tierflow.testing import MotoS3Server, ProxyProcess, fake_credentials_env

    os.environ.update(fake_credentials_env())
    with MotoS3Server() as server, ProxyProcess(server.endpoint_url) as proxy:
        yield S3Rig(server, proxy, server.create_bucket(bucket))
