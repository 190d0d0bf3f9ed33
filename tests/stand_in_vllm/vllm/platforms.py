"""vllm.platforms of the stand-in: a CPU build."""


class _Platform:
    @staticmethod
    def is_cpu() -> bool:
        return True


current_platform = _Platform()
