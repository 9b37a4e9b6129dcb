"""Canonical dimension names and the capture dataset schema.

All of kverr names dims the same way, so that a capture, a decomposition and a calibration
result can be aligned by name. Arrays handed to the numerical core follow the axis order
``[..., kv_head, token, channel]`` for keys and values and ``[..., q_head, query, channel]``
for queries.
"""

from __future__ import annotations

#: Transformer layer index.
LAYER = "layer"
#: Key/value head index (grouped-query attention: several query heads share one).
KV_HEAD = "kv_head"
#: Query head index.
Q_HEAD = "q_head"
#: Token position in the captured sequence (keys and values).
TOKEN = "token"
#: Query position, a subset of tokens (decomposition results).
QUERY = "query"
#: Head-dimension channel.
CHANNEL = "channel"

#: Version of the capture dataset schema; bumped on any incompatible change.
SCHEMA_VERSION = 1

#: Variables of a capture dataset and their dims.
CAPTURE_VARS: dict[str, tuple[str, ...]] = {
    "q": (LAYER, Q_HEAD, TOKEN, CHANNEL),  # queries, post-RoPE
    "k_pre": (LAYER, KV_HEAD, TOKEN, CHANNEL),  # keys before RoPE
    "k": (LAYER, KV_HEAD, TOKEN, CHANNEL),  # keys after RoPE (what the model caches)
    "v": (LAYER, KV_HEAD, TOKEN, CHANNEL),  # values
    "token_id": (TOKEN,),
    "position": (TOKEN,),
}

#: Coordinate mapping each query head to the kv head it reads (grouped-query attention).
KV_HEAD_OF_Q = "kv_head_of_q"


def layer_positions(have, wanted) -> list[int]:
    """Positions along ``layer`` of the layer indices ``wanted``.

    Layers are always named by their index in the model (the ``layer`` coordinate values,
    e.g. 0, 15, 29 in a capture of three layers), never by their position in a dataset.

    Parameters
    ----------
    have : sequence of int
        The dataset's ``layer`` coordinate values.
    wanted : sequence of int
        Layer indices to select.

    Returns
    -------
    list of int
        One position per wanted layer, in the order given.

    Raises
    ------
    kverr.exceptions.ShapeError
        A wanted layer is not in ``have``; the message lists the layers there are.
    """
    from kverr.exceptions import ShapeError

    index = {int(x): i for i, x in enumerate(have)}
    bad = [int(x) for x in wanted if int(x) not in index]
    if bad:
        raise ShapeError(
            f"layers {bad} are not in the capture; it has layers {sorted(index)} "
            "(give layer indices as `kverr info` lists them)"
        )
    return [index[int(x)] for x in wanted]
