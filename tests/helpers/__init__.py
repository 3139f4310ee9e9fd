"""What the tests share: `trainer` (the quiet Trainer), `fakes` (a fake allocator and the callbacks, logger and
snapshot that go with it), `models`, `microbatch` (AutoMicrobatch's models), `tensorboard` (reading layouts back)."""
