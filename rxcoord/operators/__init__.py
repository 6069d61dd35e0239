"""rxcoord's pipeable operators, shaped like ``reactivex.operators``."""

from ._serialize_by_key import serialize_by_key

__all__ = ["serialize_by_key"]
