"""The pure on-policy turn core: no Ray, HTTP or Redis imports.

``build_prompt`` (state + request -> prompt ids, or fork / HistoryConflict), the engine generates,
``parse_output`` (ids -> assistant message, vLLM's parsers), ``finish_turn`` (-> TurnDelta the store
appends). ``state_from_echo`` feeds the same algorithm from NeMo Gym's echoed ids (stateless mode),
``plan_on_prefix`` from a required token prefix (NeMo Gym's ``required_prefix_token_ids``).
See docs/onpolicy.md.
"""

from rollout_service.onpolicy.echo import has_echo, state_from_echo
from rollout_service.onpolicy.errors import (
    HistoryConflict,
    InvalidPrefix,
    OnPolicyError,
    PrefixNotContinuable,
    UnsupportedConversation,
)
from rollout_service.onpolicy.messages import canonical_message, first_difference, render_message
from rollout_service.onpolicy.parsing import AssistantOutput, parse_output
from rollout_service.onpolicy.prefix import checked_prefix, plan_on_prefix
from rollout_service.onpolicy.template import ChatTemplate, WindowMismatch
from rollout_service.onpolicy.turn import PromptPlan, build_prompt, finish_turn
from rollout_service.onpolicy.types import RolloutState, Segment, TurnDelta, TurnRecord, WeightSpan

__all__ = [
    "AssistantOutput",
    "ChatTemplate",
    "HistoryConflict",
    "InvalidPrefix",
    "OnPolicyError",
    "PrefixNotContinuable",
    "PromptPlan",
    "RolloutState",
    "Segment",
    "TurnDelta",
    "TurnRecord",
    "UnsupportedConversation",
    "WeightSpan",
    "WindowMismatch",
    "build_prompt",
    "canonical_message",
    "checked_prefix",
    "finish_turn",
    "first_difference",
    "has_echo",
    "parse_output",
    "plan_on_prefix",
    "render_message",
    "state_from_echo",
]
