import sys, time
sys.path[:0] = ["test", "test/gpu"]


def main() -> None:
    from test_tensor_parallel_cuda import _args, PROMPTS, GREEDY, MODES
    from replaylm.entrypoints.engine import Engine
    args = _args(MODES[0], "float32", 2)
    args.disable_overlap_schedule = sys.argv[1] == "off"
    t = time.time()
    e = Engine(**vars(args))
    print("built", time.time() - t, flush=True)
    out = e.generate(input_ids=PROMPTS[:4], sampling_params={**GREEDY, "max_new_tokens": 4})
    print("4 done", time.time() - t, [o["output_ids"] for o in out], flush=True)
    out = e.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    print("all done", time.time() - t, flush=True)
    e.shutdown()
    print("shut", time.time() - t, flush=True)


if __name__ == "__main__":
    main()
