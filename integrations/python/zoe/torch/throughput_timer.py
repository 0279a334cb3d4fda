"""DeepSpeed's throughput timer, as the engine zoe.torch.initialize returns keeps it
(``engine.tput_timer``)."""

import time


class ThroughputTimer:
    """DeepSpeed's ThroughputTimer (deepspeed/utils/timer.py), driven by the engine: ``start()``
    as a micro-batch's forward begins, ``stop(global_step)`` at the end of its ``step()``
    (``global_step``: the boundary's). Once ``start_step`` optimizer steps have passed
    (warm-up), the time from the latest start to each stop is summed; ``avg_samples_per_sec()``
    is the batch size over the mean of that time per optimizer step since (-inf until then).
    ``synchronize`` (a function, or None) runs before ``clock`` is read (DeepSpeed's
    ``timers.throughput.synchronized``). zoe logs nothing: a script reads the rate."""

    def __init__(self, batch_size, enabled=True, synchronize=None, start_step=2,
                 clock=time.perf_counter):
        self.batch_size = batch_size
        self.enabled = enabled
        self.start_step = start_step
        self._synchronize = synchronize
        self._clock = clock
        self.started = False
        self.start_time = None  # set by the first start() after the warm-up
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0

    def update_epoch_count(self):
        """A script's call at the end of an epoch."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def _now(self):
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()

    def start(self):
        if not self.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step=False):
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += int(bool(global_step))
        if self.start_time is not None:
            self.total_elapsed_time += self._now() - self.start_time

    def avg_samples_per_sec(self):
        """Samples per second over the optimizer steps after the warm-up; -inf before one."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0.0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
