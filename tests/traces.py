"""Checks of written Chrome traces that the unit and the distributed timeline tests share."""

import json
from collections import defaultdict
from decimal import Decimal


def check_nesting_exact(path):
    """Spans of each track nest or are disjoint exactly, in the decimal text of the file."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f, parse_float=Decimal)["traceEvents"]
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[e["pid"], e["tid"]].append((Decimal(e["ts"]), Decimal(e["ts"] + e["dur"])))
    for key, track in tracks.items():
        stack = []
        for start, end in sorted(track, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1] <= start:
                stack.pop()
            assert not stack or end <= stack[-1], (
                f"{key}: a span ending at {end} overlaps one ending at {stack[-1]}"
            )
            stack.append(end)
    return sum(map(len, tracks.values()))
