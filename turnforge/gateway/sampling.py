"""Who owns a request's sampling settings while the gateway trains (``agent.sampling``).

The trainer re-scores the tokens the gateway records with their sampling logprobs, so while
it trains it owns the settings that shape the sampling distribution: the temperature (the
run's ``rollout.temperature`` for RL episodes, the evaluation's for an evaluation) and top_p
(1: the full distribution). Many agent frameworks send their own (``temperature=1.0`` on
every call), and a request's other value meets the run's policy, one class each:

- ``trainer`` (``TrainerWins``, the default): the call is sampled with the trainer's value;
  the request's value is recorded on the call (``CallRecord.overrides``), counted per rollout
  (``n_overridden_*``) and warned about once per run. The recorded tokens and logprobs are
  those sampled at the trainer's settings, so training stays token-exact.
- ``strict`` (``Strict``): the request is refused with an OpenAI-style 400 naming the param
  (``SamplingRefused``); its rollout is an infrastructure failure, whether or not the agent
  goes on.

Under both, a max_tokens above the context left after the prompt (``rollout.max_context_tokens``;
a request without one samples at most ``rollout.max_new_tokens``) is capped, recorded and
counted as an override of ``max_tokens``. Serving (``turnforge serve``, no trainer
temperature) uses a request's temperature as sent and refuses top_p < 1 (the sampler has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from turnforge.gateway.render import RequestError

SAMPLING_PARAMS = ("temperature", "top_p", "max_tokens")  # what an override can be of (``n_overridden_<param>``)


@dataclass(frozen=True)
class Override:
    """A request's sampling setting that the call was not sampled with."""

    param: str  # one of SAMPLING_PARAMS
    requested: float  # the request's value, as sent
    used: float  # the value the call was sampled with (the trainer's)


class SamplingRefused(RequestError):
    """A request refused for a sampling setting the trainer owns (``agent.sampling=strict``)."""


class SamplingPolicy:
    """What a training gateway does with a request's temperature or top_p other than the trainer's."""

    name: ClassVar[str]

    def settle(self, param: str, requested: float, used: float, why: str) -> Override:
        """The override to record when the call is sampled with ``used``; raises
        ``SamplingRefused`` (saying ``why`` the trainer owns ``param``) to refuse the request."""
        raise NotImplementedError


class TrainerWins(SamplingPolicy):
    """``agent.sampling=trainer``: the trainer's value wins and the request's is recorded."""

    name = "trainer"

    def settle(self, param: str, requested: float, used: float, why: str) -> Override:
        return Override(param, requested, used)


class Strict(SamplingPolicy):
    """``agent.sampling=strict``: the request is refused."""

    name = "strict"

    def settle(self, param: str, requested: float, used: float, why: str) -> Override:
        raise SamplingRefused(f"{param}={requested!r}: {why}; leave it out or send {used!r} (agent.sampling=strict; "
                              "agent.sampling=trainer samples such requests with the trainer's value)", param,
                              "unsupported_value")


SAMPLING_POLICIES: dict[str, SamplingPolicy] = {p.name: p for p in (TrainerWins(), Strict())}


def settle_sampling(body: dict[str, Any], trainer_temperature: float | None,
                    policy: SamplingPolicy) -> tuple[float, tuple[Override, ...]]:
    """The temperature a request is sampled at and the overrides of its temperature and top_p
    (module docstring); ``RequestError`` for a value out of range, or one ``policy`` refuses.
    ``trainer_temperature``: the trainer's, or None when serving."""
    t = body.get("temperature")
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2):
        raise RequestError(f"temperature={t!r} must be a number in [0, 2]", "temperature")
    p = body.get("top_p")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1):
        raise RequestError(f"top_p={p!r} must be a number in [0, 1]", "top_p")
    if trainer_temperature is None:  # serving: the request's temperature, and no top_p below 1
        if p is not None and p < 1:
            raise RequestError(f"top_p={p!r}: only top_p=1 (the gateway samples the full distribution)", "top_p")
        return 1.0 if t is None else float(t), ()
    overrides = []
    if t is not None and float(t) != trainer_temperature:
        overrides.append(policy.settle("temperature", t, trainer_temperature,
                                       f"this gateway is training at temperature {trainer_temperature}"))
    if p is not None and p < 1:
        overrides.append(policy.settle("top_p", p, 1.0, "the trainer samples and scores the full distribution"))
    return trainer_temperature, tuple(overrides)


def cap_tokens(requested: int | None, default: int, room: int) -> tuple[int, Override | None]:
    """The most tokens a call samples: the request's max_tokens (``requested``; ``default``,
    ``rollout.max_new_tokens``, when not sent) within the context ``room`` left after the
    prompt (``rollout.max_context_tokens``); the override when a requested value was capped."""
    used = min(requested or default, room)
    return used, Override("max_tokens", requested, used) if requested is not None and requested > used else None


def warning(overrides: tuple[Override, ...], policy: SamplingPolicy) -> str:
    """The run's one line about the first call whose settings the trainer overrode."""
    trainer = {"temperature": lambda o: f"at temperature {o.used!r}", "top_p": lambda o: "with top_p=1",
               "max_tokens": lambda o: f"at most {o.used} tokens (the context left in "
                                       "rollout.max_context_tokens)"}
    sent = " and ".join(f"{o.param}={o.requested!r}" for o in overrides)
    theirs = " and ".join(trainer[o.param](o) for o in overrides)
    values = "its values win" if len(overrides) > 1 else "its value wins"
    if all(o.param == "max_tokens" for o in overrides):
        how = "under any agent.sampling"
    else:
        how = f"agent.sampling={policy.name}; agent.sampling=strict refuses such requests"
    return f"the agent sent {sent}; the trainer samples {theirs} and {values} ({how})"
