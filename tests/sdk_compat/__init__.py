"""Programs that talk to `mindio_ttp` (Huawei's SDK or sdk/), for tests/test_sdk_*.py."""
