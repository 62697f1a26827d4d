"""The configs the real-process tests start from (each test adds what it is about)."""

# a decoupled run of gpt-tiny as two learner processes
TINY = ["model='gpt-tiny'", "methods=['decoupled']", "runtime='processes'", "train.learners=2"]
# ... with small steps, four fragments, an evaluation every 8000 tokens, a quick detection
SMALL = [
    *TINY,
    "train.batch_size=4",
    "train.warmup_steps=5",
    "train.eval_every=8000",
    "sync.fragments=4",
    "sync.sync_every=8",
    "data.eval_batches=1",
    "processes.detect_seconds=3.0",
]
# ... short: 12000 tokens in steps of 2 sequences, two fragments sent every 4 steps
SHORT = [
    *TINY,
    "train.batch_size=2",
    "train.tokens=12000",
    "train.eval_every=6000",
    "sync.fragments=2",
    "sync.sync_every=4",
    "data.eval_batches=1",
]
# ... run until the test's hook stops it, one eval batch at the end, a quick detection
UNTIL_STOPPED = [
    "train.tokens=10000000",
    "train.eval_every=1000000",
    "data.eval_batches=1",
    "processes.detect_seconds=3.0",
]
