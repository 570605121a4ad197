"""Device-to-host copies queued during a step (host_copies.DeviceToHost) hold the device's values once waited on.

The CUDA case is what the queueing is for (pinned memory, no wait until the step's own); on CPU the same calls
must stay plain reads, so the engine runs one path everywhere.
"""

from __future__ import annotations

import pytest
import torch

from services.modeling.host_copies import DeviceToHost


def test_on_cpu_a_queued_copy_is_the_tensor_itself_and_waiting_is_free():
    source = torch.arange(12.0).view(3, 4)
    to_host = DeviceToHost()
    host = to_host.queue(source[1:])
    to_host.wait()
    assert host.data_ptr() == source[1:].data_ptr()  # no copy: the CPU path costs nothing
    assert torch.equal(host, source[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: queues copies into pinned memory")
def test_on_cuda_queued_copies_land_in_pinned_memory_by_the_wait():
    to_host = DeviceToHost()
    sources = [torch.randn(64, 5, 576, device="cuda") for _ in range(3)]
    expected = [source[:, :3].cpu() for source in sources]
    hosts = [to_host.queue(source[:, :3]) for source in sources]
    for source in sources:
        source.zero_()  # queued behind the copies on the stream: they read the values before this runs
    to_host.wait()
    for host, values in zip(hosts, expected, strict=True):
        assert host.is_pinned() and host.device.type == "cpu"
        assert torch.equal(host, values)
