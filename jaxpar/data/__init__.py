"""Input: the built-in data sources and their registry, token shards, `jaxpar data prepare`."""
