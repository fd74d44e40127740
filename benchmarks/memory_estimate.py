"""The memory estimate per device (``keras_cnnpar.strategies.memory``) against the allocator's peak in a plan
trial, for the resnet under Single, DataParallel(2) and ChannelSharded(2) at several global batches (target: within
25%).

The measured figure is a plan trial's: the allocator's peak during the timed epochs, above the memory in use when
the trial's fit began, divided by the devices (TensorFlow's CPU allocator serves every logical CPU device).

Run: python benchmarks/memory_estimate.py [--model resnet] [--batches 32,64,128]
"""

import argparse

from timing import cnnpar, training_split

from keras_cnnpar.plan import planner

TARGET = 0.25


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--batches", default="32,64,128")
    args = parser.parse_args()
    train = training_split()
    model = cnnpar.models.cnn(args.model)
    print(f"{'batch':>5} {'configuration':38} {'MiB est':>8} {'MiB run':>8} {'est/run':>8}  within {TARGET:.0%}")
    for batch in (int(b) for b in args.batches.split(",")):
        candidates = [cnnpar.Single(), cnnpar.DataParallel(2), cnnpar.ChannelSharded(2)]
        plan = planner.plan(model, train.x, train.y, batch_size=batch, candidates=candidates, cache=False,
                            log=lambda line: None)
        for trial in plan.trials:
            ratio = trial.memory_estimate_mib / trial.memory_measured_mib
            print(f"{batch:>5} {trial.configuration:38} {trial.memory_estimate_mib:8.1f} "
                  f"{trial.memory_measured_mib:8.1f} {ratio:8.2f}  {'yes' if abs(ratio - 1) <= TARGET else 'no'}",
                  flush=True)


if __name__ == "__main__":
    main()
