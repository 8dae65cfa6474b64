"""Which component of a layout plays which part in a request.

A session moves at most one chunked component (KV or MLA: it travels chunk by chunk,
as prefill computes it), at most one aux component (one row per request, which also
carries the request's arrival guard, :mod:`~kvhandoff.session.request.aux`), and any number of
state components (they travel whole, with the last chunk). Pure: no I/O.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvhandoff.layout import Layout, RowKind, TensorSpec
from kvhandoff.state_types import StateType

_CHUNKED = (StateType.KV, StateType.MLA)


@dataclass(frozen=True, slots=True)
class Components:
    """The parts of one layout; build with :meth:`of`."""

    kv: str | None  # the KV/MLA component
    aux: str | None  # the aux component
    aux_tensor: TensorSpec | None  # its one live tensor
    states: tuple[str, ...]  # every other component, in layout order
    kv_repageable: bool  # the KV component can be re-paged by token rows

    @classmethod
    def of(cls, layout: Layout) -> Components:
        """Raises ``ValueError`` for more than one KV/MLA or aux component, or an aux
        component that does not hold exactly one live tensor."""
        kv = [c for c in layout.components if c.type in _CHUNKED]
        ax = [c for c in layout.components if c.type is StateType.AUX]
        if len(kv) > 1 or len(ax) > 1:
            raise ValueError(f"a layout may hold at most one KV/MLA component and one aux "
                             f"component; got {[c.name for c in kv]} and {[c.name for c in ax]}")
        aux_tensor = None
        if ax:
            live = [t for t in ax[0].tensors if not t.elided]
            if len(live) != 1:
                raise ValueError(f"aux component {ax[0].name!r} must hold one tensor, has "
                                 f"{len(live)}")
            aux_tensor = live[0]
        special = {c.name for c in kv + ax}
        return cls(kv=kv[0].name if kv else None, aux=ax[0].name if ax else None,
                   aux_tensor=aux_tensor,
                   states=tuple(c.name for c in layout.components if c.name not in special),
                   kv_repageable=bool(kv) and repageable(layout, kv[0].name))


@functools.lru_cache(maxsize=256)  # asked per request, of the few layouts a rank meets
def repageable(layout: Layout, name: str) -> bool:
    """Whether every tensor of component ``name`` holds one token row per page token, so
    its pages can be re-paged by token rows when the two sides' page sizes differ."""
    return all(t.row_kind is RowKind.TOKEN and t.rows == layout.page_size
               for t in layout.component(name).tensors if not t.elided)
