"""tierflow.order: deterministic, seekable, world-size-independent sample orders (docs/order.md)."""

from tierflow.errors import CursorFormatError, CursorMismatchError
from tierflow.order.cursor import OrderCursor
from tierflow.order.eval_order import EvalBatch, EvalOrder
from tierflow.order.future import ShardUse, future_shard_uses
from tierflow.order.layout import PartitionLayout
from tierflow.order.mixed import MixedBatch, MixedCursor, MixedOrder, MixedRankStream
from tierflow.order.mixing import MixtureSchedule
from tierflow.order.order import MicroBatch, SampleOrder
from tierflow.order.permutation import FeistelPermutation
from tierflow.order.remainder import Remainder
from tierflow.order.sample_rng import sample_rng, sample_seed, sample_seeds
from tierflow.order.stream import Batch, RankStream

__all__ = [
    "Batch",
    "CursorFormatError",
    "CursorMismatchError",
    "EvalBatch",
    "EvalOrder",
    "FeistelPermutation",
    "MicroBatch",
    "MixedBatch",
    "MixedCursor",
    "MixedOrder",
    "MixedRankStream",
    "MixtureSchedule",
    "OrderCursor",
    "PartitionLayout",
    "RankStream",
    "Remainder",
    "SampleOrder",
    "ShardUse",
    "future_shard_uses",
    "sample_rng",
    "sample_seed",
    "sample_seeds",
]
