import os

if os.environ.get("TORCHMETRICS_GRADPATCH_SYNC"):
    import torchmetrics_gradpatch  # noqa: F401  (patches at import, with the sync the variable names)

    probe = os.environ.get("FUSED_PROBE")
    if probe:  # count the fused syncs this process runs, to show that the fused path is the one taken
        import atexit

        from torchmetrics_gradpatch import _fused_sync

        original, count = _fused_sync.fused_sync, [0]

        def counted(*args, **kwargs):
            count[0] += 1
            return original(*args, **kwargs)

        def write_count() -> None:
            if count[0]:
                with open(os.path.join(probe, str(os.getpid())), "w") as out:
                    out.write(str(count[0]))

        _fused_sync.fused_sync = counted
        atexit.register(write_count)
