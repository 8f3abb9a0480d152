"""Kafka for kvidx: client settings (config.py), topic creation (topics.py), the one broker check
(reach.py), and a local single-node broker for development and tests (local.py, `kvidx kafka ...`
through commands.py). Nothing is imported here: production commands never load the launcher."""
