"""How much work a deployment holds at each point before it refuses more, computed in one place from its engine
limits: the repository writer bounds Triton's queues with it, the preprocessing stage caps its requests in flight
with it, and the gateway sizes its admission with it. Refusing early (Triton's queue-full error, the gateway's
429 with Retry-After) keeps a burst from turning into unbounded latency and memory."""

from __future__ import annotations

from dataclasses import dataclass

from ..common.limits import EngineLimits

# The default queue of a batched python model: this many full batches wait, more are refused.
QUEUED_BATCHES = 4
# The gateway admits two batches' worth at once (one batch generating, the next being preprocessed) and queues
# four times that.
GATEWAY_IN_FLIGHT_BATCHES = 2
GATEWAY_QUEUED_BATCHES = 8


@dataclass(frozen=True)
class BackPressure:
    """triton_queue: requests preprocessing and the python llm each hold waiting in Triton's dynamic batcher
    (its queue policy's max_queue_size), at each priority level: batch lines (request.BATCH_PRIORITY) have a queue of
    that size of their own. preprocessing_in_flight: requests the preprocessing stage holds at once,
    its queue plus one batch being prepared (its async execute takes batches out of Triton's queue at once, so
    the stage enforces the bound itself). gateway_in_flight / gateway_queued: chat requests the gateway serves at
    once and lets wait for a slot."""

    triton_queue: int
    preprocessing_in_flight: int
    gateway_in_flight: int
    gateway_queued: int

    @classmethod
    def plan(cls, limits: EngineLimits, triton_queue: int | None = None) -> BackPressure:
        """The plan for `limits`, with Triton's queue as given (a repository's or `serve --max-queue-size`'s),
        else QUEUED_BATCHES full batches."""
        batch = limits.max_batch_size
        queue = triton_queue or QUEUED_BATCHES * batch
        return cls(
            triton_queue=queue,
            preprocessing_in_flight=queue + batch,
            gateway_in_flight=GATEWAY_IN_FLIGHT_BATCHES * batch,
            gateway_queued=GATEWAY_QUEUED_BATCHES * batch,
        )
