"""Independent runtime bugs of the kinds issue 15 item 4 names, as temporary patches of ``impl/`` (never committed there).

Each entry of :data:`BUGS` is a context manager that patches our runtime in this process and
undoes the patch on exit.  They were written without looking at which checks would catch them,
to measure the detection power of the gate's machines (``tests/test_envelope_detection.py``):

* ``stop_suffix_link``: the Aho-Corasick stop matcher (``impl/stream.py`` ``StopMatcher``) drops
  its output links, so a stop string that ends inside a longer pattern's path (two stop strings
  sharing bytes, e.g. ``["abc", "b"]`` on ``"abd"``) is missed; only a pattern whose own trie
  node is reached fires.
* ``eos_first_only``: the ``min_new_tokens`` legality transform (``impl/policy.py``) bans only
  the first id of the EOS set, so a second EOS id can be selected before ``min_new_tokens``.
* ``min_p_upper_edge``: ``min_p`` treats ``p = 1`` (the upper edge of its range, "keep only the
  tokens as probable as the best") like ``p = 0`` and keeps everything.
* ``cancel_drops_stop_holdback``: an external close (cancel / timeout / device error) flushes the
  stream only up to the stop holdback frontier, so the bytes held back as a possible stop-string
  prefix are never delivered (the stream must flush them: no stop matched).

Source: issue 15 item 4 ("Independent bugs of real kinds in stop/stream handling, EOS sets and
sampling transforms"); M3.10 0x06 (stop match rule, stream holdback, flush on external close);
M3.8 0x0C (min_p), 0x0B (min_new_tokens legality over the EOS set).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["BUGS"]


@contextlib.contextmanager
def stop_suffix_link() -> Iterator[None]:
    from decodespec.impl.stream import StopMatcher

    original = StopMatcher.__init__

    def init(self, patterns):
        original(self, patterns)
        exact: list[int | None] = [None] * len(self._children)
        for idx, pat in enumerate(self.patterns):
            node = 0
            for byte in pat:
                node = self._children[node][byte]
            if exact[node] is None:
                exact[node] = idx
        self._match = exact  # the bug: no match inherited through the failure link
        self._delta = [{} for _ in self._children]

    StopMatcher.__init__ = init
    try:
        yield
    finally:
        StopMatcher.__init__ = original


@contextlib.contextmanager
def _transform(name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    from decodespec.impl import policy

    original = policy._TRANSFORMS[name]
    policy._TRANSFORMS[name] = make(original)
    try:
        yield
    finally:
        policy._TRANSFORMS[name] = original


def eos_first_only():
    def make(original):
        from decodespec.impl.policy import _ban, _row_mask

        def min_new_tokens(z, spec, views, states):
            return _ban(z, _row_mask(z, [v.eos_ids[:1] if len(v.output_ids) < v.min_new_tokens else () for v in views]))

        return min_new_tokens

    return _transform("min_new_tokens", make)


def min_p_upper_edge():
    def make(original):
        def min_p(z, spec, views, states):
            if spec.get("p") >= 1.0:
                return z
            return original(z, spec, views, states)

        return min_p

    return _transform("min_p", make)


@contextlib.contextmanager
def cancel_drops_stop_holdback() -> Iterator[None]:
    from decodespec.impl.stream import Streamer
    from decodespec.spec.enums import FinishReason

    original = Streamer._close
    external = {FinishReason.CANCELLED, FinishReason.TIMEOUT, FinishReason.DEVICE_ERROR}

    def close(self, fired, match, structured_end):
        if set(fired) <= external and self._matcher is not None and self._matcher.holdback:
            front = self._frontier()  # the bug: the held-back stop prefix is not flushed
            self.output = self._build_output(fired, match, structured_end)
            self.last_triggers = self.output.triggers
            return self._publish(max(front, self.delivered_bytes))
        return original(self, fired, match, structured_end)

    Streamer._close = close
    try:
        yield
    finally:
        Streamer._close = original


#: name -> context manager factory installing the bug in this process.
BUGS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "stop_suffix_link": stop_suffix_link,
    "eos_first_only": eos_first_only,
    "min_p_upper_edge": min_p_upper_edge,
    "cancel_drops_stop_holdback": cancel_drops_stop_holdback,
}
