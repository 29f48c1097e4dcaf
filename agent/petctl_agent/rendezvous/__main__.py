"""``python -m petctl_agent.rendezvous <torchrun args>``: torchrun with ``petctl-etcd`` registered."""

from petctl_agent.rendezvous import main

main()
