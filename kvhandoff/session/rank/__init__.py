"""One rank: the agent, its role's desk, its peers and groups, and the watch over them."""
