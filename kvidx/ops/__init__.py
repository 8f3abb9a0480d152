"""Operations on the index's Kafka history: replay a model's index to a past moment and explain a
routing decision (replay.py), audit credited against reused tokens (audit.py), and feed the audit back
into the credit the service gives (feedback.py). Each module exposes `add_cli(subparsers)`."""
