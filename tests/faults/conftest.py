"""The fault suite shares the unit suite's tiny random models (built once per session)."""

from tests.unit.conftest import _one_torch_thread, tiny_llama, tiny_models  # noqa: F401
