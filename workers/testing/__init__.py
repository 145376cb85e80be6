"""A testing kit, for this project's tests and for apps testing their own agents: a strict scripted
Messages API (``scripted_model``) and a whole local pool (``localpool``: a throwaway redis-server and real
worker processes). Nothing in agentpool imports it outside the tests, the demo and the bench."""
