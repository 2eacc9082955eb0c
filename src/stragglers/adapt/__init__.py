"""Self-adaptive training (AntDT): data-sharding service, monitor/controller/agent, DD and ND policies."""
