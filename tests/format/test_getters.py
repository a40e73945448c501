"""Row getters of decoded blocks: a value where the column has one, None where it is null (bitmaps at
any offset, columns null throughout), through a packed and decoded zstd shard."""

from __future__ import annotations

import pyarrow as pa

from tierflow.format.blocks import open_blocks
from tierflow.format.shard_writer import ShardWriter
from tierflow.format.table import LazyShardTable, ShardTable


def test_getters_give_none_exactly_where_the_column_is_null(tmp_path):
    schema = pa.schema(
        [("text", pa.string()), ("i", pa.int64()), ("none", pa.binary()), ("tokens", pa.list_(pa.uint16()))]
    )
    writer = ShardWriter(tmp_path, schema, compression="zstd")
    rows = []
    for n in (13, 8, 1, 30):
        batch = [
            {
                "text": None if (len(rows) + k) % 3 == 0 else f"t{k}" * 9,
                "i": None if k % 4 == 1 else k,
                "none": None,
                "tokens": None if k % 5 == 2 else [k, k + 1],
            }
            for k in range(n)
        ]
        rows += batch
        writer.write(pa.RecordBatch.from_pylist(batch, schema=schema))
    info = writer.close()
    table = LazyShardTable(info.name, open_blocks(tmp_path / info.name, info), schema)
    got = []
    for b in range(table.num_blocks):
        getters = {name: table.getter(b, name) for name in schema.names}
        for r in range(table.block_rows(b)):
            got.append(
                {
                    name: (list(v) if name == "tokens" and v is not None else v)
                    for name, v in ((name, g(r)) for name, g in getters.items())
                }
            )
    assert got == rows


def test_a_sliced_column_reads_its_own_rows_validity():
    arr = pa.array([None if i % 3 == 0 else f"s{i}" for i in range(40)]).slice(5, 20)
    table = ShardTable([pa.record_batch([arr], names=["s"])])
    get = table.getter(0, "s")
    assert [get(r) for r in range(20)] == arr.to_pylist()
