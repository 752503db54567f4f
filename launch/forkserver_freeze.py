"""Imported last by the fork server (``launch/forkserver.py``), after every module it
preloads: the objects those imports made are moved out of the garbage collector's reach
(``gc.freeze``), so that a forked role's collections do not write to them. A collection
touches every object it tracks (their reference counts and GC links), and each write to a
page that the role still shares with the server copies that page into the role: with torch
and transformers loaded, most of the server's heap, in every role. Frozen, the pages stay
shared, and each role's proportional memory (PSS) holds its share of them only."""

from __future__ import annotations

import gc

gc.collect()
gc.freeze()
