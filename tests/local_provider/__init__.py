"""A test-only Ray autoscaler node provider whose "nodes" are process groups on this machine.

`ray up` / `ray down` drive it as they drive a cloud: `provider: {type: external, module:
tests.local_provider.provider.LocalNodeProvider}`. Node commands run locally with bash (no
ssh, no docker), each node with its own home directory; file mounts are local copies.
"""
