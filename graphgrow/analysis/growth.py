"""Where new channels go when a coupling group grows: insertions carried through links, both ways.

A link says that a span of one tensor's channels *is* another tensor's channels (a `cat` input, a
slice, a split piece, one block of a reshape that splits or merges the channel axis). Growing a group
fixes the insertions of every group tied to it through links; the planner follows links forward
(the derived span grows with its source) and backward (a span that grows makes its source grow), and
checks that every link sees the same growth from both ends. A group whose channels are tied to blocks
(the groups of a grouped conv, a radix split) must receive the same number of new channels in each block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd
from typing import Any

Coupling = Any  # coupling.Coupling and coupling.Link (coupling imports this module, not the other way round)
Link = Any


@dataclass
class Insertion:
    """`count` new channels inserted before old channel `pos`; `src[i]` is the old channel new
    channel i replicates (net2net) or None (fresh)."""

    pos: int
    count: int
    src: list[int | None]


@dataclass
class Layout:
    """Where old and new channels go when a dimension of size `old` receives insertions."""

    old: int
    new: int
    old_to_new: list[int]
    new_slots: list[int]
    src: list[int | None]


def make_layout(old: int, insertions: list[Insertion]) -> Layout:
    ins = sorted(insertions, key=lambda i: i.pos)
    old_to_new, new_slots, src = [], [], []
    cursor, k = 0, 0
    for i in ins:
        while cursor < i.pos:
            old_to_new.append(cursor + k)
            cursor += 1
        for j in range(i.count):
            new_slots.append(cursor + k)
            src.append(i.src[j])
            k += 1
    while cursor < old:
        old_to_new.append(cursor + k)
        cursor += 1
    return Layout(old, old + k, old_to_new, new_slots, src)


def keeps_blocks(layout: Layout, blocks: int) -> bool:
    """Every old channel of block b lands in new block b (each block gained the same number of channels)."""
    if blocks <= 1:
        return True
    if layout.old % blocks or layout.new % blocks:
        return False
    old, new = layout.old // blocks, layout.new // blocks
    return all(p // new == c // old for c, p in enumerate(layout.old_to_new))


class Conflict(Exception):
    """The links cannot all agree on where new channels go."""


@dataclass
class Plan:
    insertions: dict[int, list[Insertion]]  # group → its insertions (groups that do not grow are left out)
    reasons: list[str] = field(default_factory=list)  # why it cannot be applied (frozen groups on the way)


def _canonical(ins: list[Insertion]) -> list[Insertion]:
    out: list[Insertion] = []
    for i in sorted(ins, key=lambda i: i.pos):
        if i.count == 0:
            continue
        if out and out[-1].pos == i.pos:
            out[-1] = Insertion(i.pos, out[-1].count + i.count, out[-1].src + list(i.src))
        else:
            out.append(Insertion(i.pos, i.count, list(i.src)))
    return out


def _key(ins: list[Insertion]) -> list[tuple]:
    return [(i.pos, i.count, tuple(i.src)) for i in _canonical(ins)]


def forward(link: Link, ins: list[Insertion]) -> list[Insertion]:
    """The source's insertions as the derived tensor sees them, in every copy of the span."""
    s, out = link.scale, []
    for j in range(link.repeat):
        base = link.offset + j * link.stride
        for i in ins:
            src = [None if x is None else base + x * s + q for x in i.src for q in range(s)]
            out.append(Insertion(base + i.pos * s, i.count * s, src))
    return out


def backward(link: Link, ins: list[Insertion], size: int, where: str) -> list[Insertion]:
    """The derived tensor's insertions inside the link's spans, as the source sees them; every copy must agree.
    An insertion at a span's end belongs to that span (new channels go at the end of what they extend)."""
    s, copies = link.scale, []
    for j in range(link.repeat):
        start = link.offset + j * link.stride
        end = start + size * s
        local = []
        for i in ins:
            if not start < i.pos <= end:
                continue
            if (i.pos - start) % s or i.count % s:
                raise Conflict(
                    f"'{where}' would need a fraction of a channel ({i.count} new features, {s} per channel)"
                )
            src = [None if x is None or not start <= x < end else (x - start) // s for x in i.src[::s]]
            local.append(Insertion((i.pos - start) // s, i.count // s, src))
        copies.append(_canonical(local))
    if any(_key(c) != _key(copies[0]) for c in copies[1:]):
        raise Conflict(f"'{where}' repeats its channels in {link.repeat} blocks that would grow differently")
    return copies[0]


def root_insertions(size: int, count: int, blocks: int, src: list[int | None] | None) -> list[Insertion]:
    """`count` new channels spread over `blocks` equal blocks, at the end of each."""
    per, width = count // blocks, size // blocks
    src = list(src) if src is not None else [None] * count
    return [Insertion((b + 1) * width, per, src[b * per : (b + 1) * per]) for b in range(blocks)]


def propagate(c: Coupling, gid: int, root: list[Insertion]) -> Plan:
    """Every group's insertions when group `gid` receives `root`; raises Conflict.

    A group not yet reached counts as not growing, and may still be reached later: a link whose one end
    grows and whose other end (within the link's span) does not yet, passes the growth on; a link whose
    two ends both grow must see the same growth from each."""
    sizes = [g.size for g in c.groups]
    plan: dict[int, list[Insertion]] = {gid: _canonical(root)}
    changed = True
    rounds = 0
    while changed:
        changed, rounds = False, rounds + 1
        if rounds > 4 * len(c.links) + 8:
            raise Conflict("the growth does not settle over the links")
        for link in c.links:
            s, d = c.group_of[link.src], c.group_of[link.dst]
            mine, theirs = plan.get(s, []), backward(link, plan.get(d, []), sizes[s], link.dst)
            if _key(mine) == _key(theirs):
                continue
            if mine and not theirs:
                plan[d] = _canonical(plan.get(d, []) + forward(link, mine))
            elif theirs and not mine:
                plan[s] = theirs
            else:
                raise Conflict(
                    f"'{link.dst}' takes channels from '{link.src}' that would grow differently on each side"
                )
            changed = True
    if _key(plan[gid]) != _key(root):
        raise Conflict(f"'{c.groups[gid].members[0]}' would have to grow elsewhere too")
    grown = {g: ins for g, ins in plan.items() if ins}
    return Plan(grown, _reasons(c, grown))


def _reasons(c: Coupling, grown: dict[int, list[Insertion]]) -> list[str]:
    reasons: list[str] = []
    touched = {c.group_of[v] for lk in c.links for v in (lk.src, lk.dst)}
    for g, ins in grown.items():
        grp = c.groups[g]
        reasons += grp.frozen
        if not grp.sources and g not in touched:
            reasons.append(f"no conv or Linear layer produces the channels of '{grp.members[0]}'")
        if grp.unit > 1 and any(i.pos % grp.unit or i.count % grp.unit for i in ins):
            reasons.append(
                f"GroupNorm over '{grp.members[0]}' normalises groups of {grp.unit} channels: new channels "
                f"must form whole new groups (grow by a multiple of {grp.unit})"
            )
        if grp.blocks > 1 and not keeps_blocks(make_layout(grp.size, ins), grp.blocks):
            reasons.append(
                f"'{grp.members[0]}' is split into {grp.blocks} blocks ({'; '.join(grp.block_reasons[:2])}) "
                "that would not each gain the same number of channels"
            )
    return list(dict.fromkeys(reasons))


def plan(c: Coupling, gid: int, count: int, src: list[int | None] | None = None) -> Plan:
    """Grow group `gid` by `count`: spread over its blocks (see `step`); raises Conflict when the links disagree."""
    multiple, _ = step(c, gid)
    blocks = c.spread.get(gid, multiple)
    if count % multiple:
        why = "; ".join(c.groups[gid].block_reasons[:2]) or "channels repeated in blocks"
        what = (
            f"spread evenly over {blocks} blocks ({why})"
            if multiple == blocks
            else f"spread as whole GroupNorm groups over {blocks} block{'s' if blocks > 1 else ''}"
        )
        raise Conflict(
            f"{count} new channels cannot be {what}; grow by a multiple of {multiple} "
            f"(e.g. to={c.groups[gid].size + multiple})"
        )
    return propagate(c, gid, root_insertions(c.groups[gid].size, count, blocks, src))


def step(c: Coupling, gid: int) -> tuple[int, list[str]]:
    """The smallest multiple by which group `gid` can grow consistently — new channels spread at the end of each
    of its blocks (`c.spread[gid]` of them), whole GroupNorm groups in each where one is reached — and the
    reasons it cannot grow (frozen groups on the way, or the first conflict)."""
    cache = c.steps
    if gid not in cache:
        size, base = c.groups[gid].size, max(c.groups[gid].blocks, 1)
        first: str | None = None
        # channels that are `scale` channels each of another group's (an interleave of strided pieces) come in whole
        # multiples of it
        grain = 1
        for link in c.links:
            if c.group_of[link.dst] == gid and c.group_of[link.src] != gid:
                grain = lcm(grain, link.scale)
        for b in [d for d in range(base, size + 1, base) if size % d == 0][:12]:
            per, found = grain, None
            for _ in range(3):  # one new channel per block; then whole GroupNorm groups of the groups reached
                try:
                    found = propagate(c, gid, root_insertions(size, b * per, b, None))
                except Conflict as e:
                    first, found = first or str(e), None
                    break
                unit = 1
                for g in found.insertions:
                    unit = lcm(unit, c.groups[g].unit)
                if unit == 1 or not any(r.startswith("GroupNorm over") for r in found.reasons) or per % unit == 0:
                    break
                per = lcm(per, unit)
            if found is None:
                continue
            cache[gid] = (b * per, found.reasons)
            c.spread[gid] = b
            break
        else:
            cache[gid] = (base, [first or "no even spread of new channels works"])
    return cache[gid]


def lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)
