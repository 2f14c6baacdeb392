"""One generation for deterministic requests (greedy, or sampled with a seed) that differ only in their
output limit.

A batch often asks the same question at several lengths (a summary at 32, 128 and 512 tokens, an
evaluation sweeping `max_tokens`). Decoding never looks ahead: each token depends on the tokens before it
(and a seeded sample on its own random stream, drawn token by token), so the answer at a shorter limit is
the longer answer's first tokens: the engine runs the request with the largest limit once, and each of the
others is answered by that generation cut where the engine would have stopped it. Outputs are built from
the cut result by the request's own handler, so usage, `finish_reason`, logprobs and ids are its own.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

from batch_pipeline.shards.format import WorkItem
from batch_pipeline.shards.records import output_limit, shared_generation_key, with_output_limit

# The text each generated token adds, as vLLM's detokenizer writes it: (prompt token ids, generated token
# ids, skip_special_tokens) -> one piece a token.
TextPieces = Callable[[list[int], list[int], bool], list[str]]


def text_pieces(tokenizer: Any) -> TextPieces | None:
    """How vLLM's fast detokenizer writes a completion's text, token by token: a `DecodeStream` primed with
    the prompt (so a tokenizer that drops a leading space at the start of a text keeps it after a prompt)
    that holds back an incomplete character until it completes. None where vLLM writes the text another
    way (no fast detokenizer for this tokenizer): its requests are not shared."""
    from tokenizers.decoders import DecodeStream

    from batch_pipeline.worker.vllm_api import uses_fast_detokenizer

    if not uses_fast_detokenizer(tokenizer):
        return None
    backend = tokenizer._tokenizer  # what vLLM's FastIncrementalDetokenizer steps its stream with

    def pieces(prompt_token_ids: list[int], token_ids: list[int], skip_special_tokens: bool) -> list[str]:
        stream = DecodeStream(ids=list(prompt_token_ids), skip_special_tokens=skip_special_tokens)
        return [stream.step(backend, token_id) or "" for token_id in token_ids]

    return pieces


class SharedGenerations:
    """Which requests an in-flight generation answers: `combine` replaces each group of a window by its
    leader, the group's first request at the group's largest limit; `answers` cuts the leader's results
    for every member, itself included."""

    def __init__(self, shareable: Callable[[WorkItem], bool], pieces: TextPieces) -> None:
        self.shareable = shareable
        self.pieces = pieces
        self._members: dict[int, list[WorkItem]] = {}  # leader index -> the requests it answers

    def combine(self, window: list[WorkItem]) -> list[WorkItem]:
        groups: dict[int, list[WorkItem]] = {}
        for item in window:
            key = shared_generation_key(item) if self.shareable(item) else None
            if key is not None:
                groups.setdefault(key, []).append(item)
        leaders: dict[int, WorkItem] = {}
        followers: set[int] = set()
        for members in groups.values():
            if len(members) > 1:
                limit = max(output_limit(member) or 0 for member in members)
                leaders[members[0].index] = with_output_limit(members[0], limit)
                self._members[members[0].index] = members
                followers.update(member.index for member in members[1:])
        return [leaders.get(item.index, item) for item in window if item.index not in followers]

    def members(self, leader_index: int) -> list[WorkItem] | None:
        """The requests a leader answers, given up by it: None for a request that leads none."""
        return self._members.pop(leader_index, None)

    def answers(self, members: list[WorkItem], results: list[Any]) -> Iterator[tuple[WorkItem, list[Any] | None]]:
        """Each member with the leader's results as the engine would have given them at its own limit; None
        where the cut could differ from the engine's own text (the member is then generated on its own)."""
        written: dict[tuple[int, int, bool], list[str] | None] = {}  # each completion's pieces, written once

        def pieces_of(position: int, result: Any, skip_special_tokens: bool, choice: int) -> list[str] | None:
            key = (position, choice, skip_special_tokens)
            if key not in written:
                written[key] = self._written(result, result.outputs[choice], skip_special_tokens)
            return written[key]

        for member in members:
            limit = output_limit(member)
            assert limit is not None  # a member of a group has a limit (shared_generation_key)
            skip_special_tokens = member.request.get("skip_special_tokens") is not False
            cut = [
                _cut(result, limit, functools.partial(pieces_of, position, result, skip_special_tokens))
                for position, result in enumerate(results)
            ]
            yield member, None if any(result is None for result in cut) else cut

    def _written(self, result: Any, completion: Any, skip_special_tokens: bool) -> list[str] | None:
        """The pieces of a completion's text, where they are the engine's own: None where the stream fails
        (vLLM's detokenizer recovers from a sequence it cannot decode, in a way of its own) or disagrees
        with the engine's text (which is these pieces, or their start where a stop string cut it)."""
        prompt_token_ids = list(result.prompt_token_ids or [])
        try:
            pieces = self.pieces(prompt_token_ids, list(completion.token_ids), skip_special_tokens)
        except Exception:
            return None
        return pieces if "".join(pieces).startswith(completion.text) else None


def _cut(result: Any, limit: int, written: Callable[[int], list[str] | None]) -> Any | None:
    """A vLLM RequestOutput at `limit` tokens a prompt (None where a completion's text cannot be cut as the
    engine writes it: `written(choice)`). A completion no longer than the limit stopped on its own before
    it (end of sequence, a stop string or token, the context), and so does the shorter request: the engine
    checks those stops before the limit. A longer one is cut: the first `limit` tokens, finished by length,
    with the text the engine wrote for them (no stop string was whole in it, or the longer one would have
    stopped there)."""
    outputs = []
    for choice, completion in enumerate(result.outputs):
        if len(completion.token_ids) <= limit:
            outputs.append(completion)
            continue
        pieces = written(choice)
        if pieces is None:
            return None
        token_ids = list(completion.token_ids[:limit])
        logprobs = completion.logprobs[:limit] if completion.logprobs is not None else None
        outputs.append(
            dataclasses.replace(
                completion,
                token_ids=token_ids,
                text="".join(pieces[:limit]),
                logprobs=logprobs,
                cumulative_logprob=(
                    sum(position[token].logprob for token, position in zip(token_ids, logprobs, strict=True))
                    if logprobs is not None and completion.cumulative_logprob is not None
                    else None
                ),
                finish_reason="length",
                stop_reason=None,
            )
        )
    cut = copy.copy(result)
    cut.outputs = outputs
    return cut
