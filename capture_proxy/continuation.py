"""Exact-token continuation around the capture path: plan a call, route it, record its reply.

``Continuations.plan`` decides (capture_proxy/stitch.py) whether a chat request continues one of
the agent's recorded calls and, in ``stitch`` mode, has :class:`~capture_proxy.stitch_ids.StitchIds`
build the stitched prompt: from the engine's renders (the full request's and the head's, or the
full one alone where a stitch of the same head shape has shown that the head render would cut at
the same place), or from the proxy's own render of the model's chat template
(``continuation_template_dir``) where a stitch of the same head shape has shown it is the engine's.
A stitched call goes to the engine's own chat route with the stitched ids forwarded in
``kv_transfer_params.prompt_token_ids`` (vLLM's decode-side token reuse: the ids are the prompt,
the chat template and tokenizer are skipped, and the answer is the chat route's own — text, stop
strings, vLLM's tool and reasoning parsers, log-probabilities, streaming). Its answer is then an
ordinary chat completion whose ``prompt_token_ids`` are the stitched ids, so capture and
scrubbing are the pass-through path's. Everything else passes through.

Per call, ``calls.continuation`` keeps a :class:`~capture_contracts.bundle.ContinuationRecord`: the
mode, the message hashes, whether it was stitched and why not, and the call it extends (the drift
report, :mod:`capture_contracts.drift`, is computed from it).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from capture_contracts.bundle import ContinuationRecord
from capture_contracts.vocabulary import Endpoint, FallbackReason
from capture_proxy.message_chain import chain, chain_next, tools_hash
from capture_proxy.settings import Settings
from capture_proxy.stitch import (
    Extends,
    Fresh,
    OwnRender,
    PriorCall,
    Priors,
    ReplyAccumulator,
    Stitched,
    reply_message,
)
from capture_proxy.stitch_ids import StitchIds, TokenPathUnavailable
from capture_proxy.store.records import CompletedChatCall, Generation
from capture_proxy.store.repository import Store
from capture_proxy.upstream import Upstream

log = logging.getLogger(__name__)

#: Choices worth a second look after reading the agent's calls completed elsewhere since.
_LOOK_AGAIN = frozenset({"no_previous_call", "not_an_extension"})
#: Content parts vLLM renders as text (vLLM's ``has_non_text_content``: a forwarded prompt is
#: ignored for the others); and words that name media in a part's keys, whatever its type.
_TEXT_PARTS = frozenset(
    {"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"}
)
_MEDIA_WORDS = ("image", "audio", "video", "file", "embeds")


@dataclass(slots=True)
class Plan:
    record: ContinuationRecord | None  # stored in calls.continuation
    prefix_hash: str | None = None
    #: A stitched call: the chat body sent instead of the prepared one (the stitched ids
    #: forwarded in ``kv_transfer_params``).
    body: dict[str, Any] | None = None
    replies: ReplyAccumulator = field(default_factory=ReplyAccumulator)

    def upstream_body(self, prepared: dict[str, Any]) -> dict[str, Any]:
        """The body the engine is sent for this call."""
        return prepared if self.body is None else self.body


def rendered_by_engine(body: dict[str, Any]) -> FallbackReason | None:
    """Why vLLM would render this request itself, ignoring forwarded prompt ids: ``echo``
    (the answer repeats the rendered last message), or a content part that is not text (the
    media go with the messages, not with the ids)."""
    if body.get("echo"):
        return "echo"
    for message in body["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type", "text") not in _TEXT_PARTS
                or any(word in key for key in part for word in _MEDIA_WORDS)
            ):
                return "media_content"
    return None


def _own_render(record: ContinuationRecord) -> OwnRender | None:
    if record.prefilled or record.render_len is None or record.render_digest is None:
        return None
    return OwnRender(record.render_len, record.render_digest)


def _rendered_prompt(record: ContinuationRecord) -> bool:
    """Whether a call's prompt is the engine's render of its request, ending at the generation
    prompt (it was not stitched, nor prefilled)."""
    return not record.stitched and not record.prefilled


def _prior(call: CompletedChatCall) -> PriorCall | None:
    """What stitching needs of a recorded call (calls recorded without message hashes: none)."""
    record = call.continuation
    if record.prefix_hash is None or record.messages is None:
        return None
    return PriorCall(
        call_id=call.call_id,
        completed_seq=call.completed_seq,
        role=call.role,
        messages=record.messages,
        prefix_hash=record.prefix_hash,
        reply_hash=call.reply_hash,
        tools_hash=record.tools_hash or "",
        rendered_prompt=_rendered_prompt(record),
        render=_own_render(record),
    )


class Continuations:
    """Plans chat calls; keeps each agent's recorded calls indexed in memory (bounded LRU).

    The index of an (episode, agent) is kept up to date by the completions this process records
    (:meth:`remember`). When it finds no call to continue for a request that holds a reply (an
    assistant message: a request without one continues no call), the calls the agent completed
    that this process has not read yet (through another proxy process sharing the store) are
    read by ``completed_seq`` — an indexed range, never a scan of the episode.
    """

    def __init__(self, settings: Settings, store: Store, upstream: Upstream) -> None:
        self.mode = settings.continuation
        self.store = store
        self.upstream = upstream
        self.ids = StitchIds(settings, store, upstream)  # the engine's renders, or the proxy's
        self._priors: OrderedDict[tuple[str, str | None], Priors] = OrderedDict()
        self._max_agents = settings.continuation_cache_agents
        self._warned_ids_ignored = False

    async def _catch_up(self, key: tuple[str, str | None], priors: Priors) -> None:
        """Add the agent's calls completed elsewhere since the last look (this process's own
        are added as they complete: :meth:`remember`). Nobody else having committed to the
        store since that look (SQLite: ``Store.changes_elsewhere``), there are none: no read."""
        version = self.store.changes_elsewhere()
        if version is not None and version == priors.seen_elsewhere:
            return
        found = await self.store.chat_calls_since(key[0], key[1], priors.read_until)
        priors.seen_elsewhere = version  # (read before the look: a commit after it is looked at)
        for call in found:
            priors.read_until = max(priors.read_until, call.completed_seq)
            prior = _prior(call)
            if prior is not None:
                priors.add(prior)

    async def _choose(
        self,
        episode_id: str,
        agent_id: str | None,
        hashes: list[str],
        tools: str,
        replies: bool,
    ) -> Extends | Fresh:
        """``replies``: the request holds an assistant message. Without one it extends no call
        (a call is extended when the request holds its reply, an assistant message), so the
        store is not read for calls completed elsewhere: the first call of every context (an
        agent's, a worker's, the rewrite after a compaction) costs no read — on PostgreSQL, one
        round trip fewer. The reason recorded is then the one the calls in memory give."""
        key = (episode_id, agent_id)
        priors = self._priors.get(key)
        if priors is None:
            priors = self._priors[key] = Priors()
            if len(self._priors) > self._max_agents:
                self._priors.popitem(last=False)
            if replies:
                await self._catch_up(key, priors)
            return priors.choose(hashes, tools)
        self._priors.move_to_end(key)
        choice = priors.choose(hashes, tools)
        if replies and isinstance(choice, Fresh) and choice.reason in _LOOK_AGAIN:
            await self._catch_up(key, priors)
            choice = priors.choose(hashes, tools)
        return choice

    def remember(
        self,
        episode_id: str,
        agent_id: str | None,
        role: str,
        plan: Plan | None,
        call_ids: Sequence[str],
        generations: Sequence[Generation],
        completed_seqs: Sequence[int],
    ) -> None:
        """Index the chat calls this process just completed (their reply hashes are set)."""
        priors = self._priors.get((episode_id, agent_id))
        record = plan.record if plan is not None else None
        if priors is None or record is None or record.prefix_hash is None:
            return
        for call_id, gen, seq in zip(call_ids, generations, completed_seqs, strict=True):
            priors.add(
                PriorCall(
                    call_id=call_id,
                    completed_seq=seq,
                    role=role,
                    messages=record.messages or 0,
                    prefix_hash=record.prefix_hash,
                    reply_hash=gen.reply_hash,
                    tools_hash=record.tools_hash or "",
                    rendered_prompt=_rendered_prompt(record),
                    render=_own_render(record),
                )
            )

    # -- planning ---------------------------------------------------------------------------

    async def plan(
        self,
        episode_id: str,
        endpoint: Endpoint,
        agent_id: str | None,
        body: dict[str, Any],
    ) -> Plan:
        """``body``: the request as prepared for the engine (capture fields added)."""
        if endpoint != "chat":
            return Plan(ContinuationRecord(stitched=False, reason="not_chat", mode=self.mode))
        messages: list[dict[str, Any]] = body["messages"]
        hashes = chain(messages)
        tools = tools_hash(body)
        prefilled = body.get("continue_final_message") is True
        prefilled = prefilled or body.get("add_generation_prompt") is False
        record = ContinuationRecord(
            stitched=False,
            mode=self.mode,
            messages=len(messages),
            prefix_hash=hashes[-1],
            tools_hash=tools,
            prefilled=prefilled or None,
        )
        plan = Plan(record, prefix_hash=hashes[-1])
        replies = any(message.get("role") == "assistant" for message in messages)
        choice = await self._choose(episode_id, agent_id, hashes, tools, replies)
        if isinstance(choice, Fresh):
            base = choice.base.call_id if choice.base else None
            plan.record = replace(record, reason=choice.reason, base_call_id=base)
            return plan
        record = replace(record, base_call_id=choice.base.call_id)
        if self.mode == "passthrough":
            plan.record = replace(record, reason="passthrough_mode")
            return plan
        rendered = rendered_by_engine(body)
        if rendered is not None:
            plan.record = replace(record, reason=rendered)
            return plan
        try:
            outcome = await self._stitch(body, choice)
        except TokenPathUnavailable:
            outcome = "token_path_unavailable"
        if isinstance(outcome, str):
            plan.record = replace(record, reason=outcome)
            return plan
        stitched, renders, own = outcome
        plan.record = replace(
            record,
            stitched=True,
            base_len=stitched.base_len,
            suffix_len=len(stitched.trailer) + len(stitched.suffix),
            renders=renders,
            render_len=None if prefilled or own is None else own.length,
            render_digest=None if prefilled or own is None else own.digest,
        )
        forwarded = body.get("kv_transfer_params")
        forwarded = forwarded if isinstance(forwarded, dict) else {}
        plan.body = body | {
            "kv_transfer_params": forwarded | {"prompt_token_ids": stitched.prompt_ids}
        }
        return plan

    async def _stitch(
        self, body: dict[str, Any], choice: Extends
    ) -> tuple[Stitched, int, OwnRender | None] | FallbackReason:
        return await self.ids.stitch(body, choice.base)

    # -- recording --------------------------------------------------------------------------

    def replies(
        self, plan: Plan | None, generations: list[Generation], answer: Any = None
    ) -> list[Generation]:
        """Attach to each choice the hash of its request plus the assistant message returned."""
        if plan is None or plan.prefix_hash is None:
            return generations
        if plan.body is not None:
            self._check_reused(plan.body, generations)
        prefix = plan.prefix_hash
        if isinstance(answer, dict):
            choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
            messages = [reply_message(c) for c in choices]
        else:
            messages = [plan.replies.message(i) for i in range(len(generations))]
        return [
            replace(gen, reply_hash=chain_next(prefix, message))
            for gen, message in zip(generations, messages, strict=False)
        ]

    def _check_reused(self, sent: dict[str, Any], generations: list[Generation]) -> None:
        """Warn (once) when the engine generated on another prompt than the stitched ids it was
        sent. The capture keeps the prompt the engine used, so the data stays exact; only the
        call's continuation record, committed at admission, says stitched."""
        ids = sent["kv_transfer_params"]["prompt_token_ids"]
        if self._warned_ids_ignored or all(gen.prompt_token_ids == ids for gen in generations):
            return
        self._warned_ids_ignored = True
        log.warning(
            "the engine did not generate on the stitched prompt ids it was sent (a vLLM without"
            " decode-side token reuse in kv_transfer_params?): stitched calls are recorded with"
            " the prompt the engine rendered itself"
        )
