"""Engine-side subcommands of the `tidepool` CLI. Imports of torch and the engine stay inside the handlers."""
import sys


def register(sub) -> None:
    p = sub.add_parser("make-tiny-model", help="write a seeded random-weight model (HF layout) for tests")
    p.add_argument("dir", help="output folder")
    p.add_argument("--arch", choices=("llama", "mistral", "qwen2"), default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=make_tiny_model)

    models = sub.add_parser("models", help="manage the models folder ($TIDEPOOL_MODELS_DIR, default ./models)")
    models_sub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    p = models_sub.add_parser("pull", help="download a known model once and write it as an HF folder")
    p.add_argument("name", help="e.g. smollm2-135m")
    p.set_defaults(func=models_pull)
    p = models_sub.add_parser("list", help="list the model folders present")
    p.set_defaults(func=models_list)


def make_tiny_model(args) -> int:
    from workers.engine.tiny_model import make_tiny_model

    out = make_tiny_model(args.dir, arch=args.arch, seed=args.seed)
    print(out)
    return 0


def models_pull(args) -> int:
    from workers.engine.model_pull import MODELS, pull_model

    if args.name not in MODELS:
        print(f"unknown model {args.name!r}; known: {', '.join(sorted(MODELS))}", file=sys.stderr)
        return 2
    pull_model(args.name)
    return 0


def models_list(args) -> int:
    from workers.engine.model_pull import list_models, models_dir

    for name in list_models():
        print(models_dir() / name)
    return 0
