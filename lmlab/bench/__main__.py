import sys

if sys.argv[1:2] == ["data"]:  # python -m lmlab.bench data ...: the data pipeline's benchmark
    from lmlab.bench.data import main

    main(sys.argv[2:])
elif sys.argv[1:2] == ["attention"]:  # python -m lmlab.bench attention ...: masked attention paths vs full
    from lmlab.bench.attention import main

    main(sys.argv[2:])
elif sys.argv[1:2] == ["mixer"]:  # python -m lmlab.bench mixer ...: recurrent mixers vs full attention
    from lmlab.bench.mixer import main

    main(sys.argv[2:])
elif sys.argv[1:2] == ["train"]:  # python -m lmlab.bench train --name N -- overrides: train.py's perf figures
    from lmlab.bench.train_run import main

    main(sys.argv[2:])
elif sys.argv[1:2] in (["env"], ["summary"]):  # the GPU check's environment record and its summary
    from lmlab.bench.suite import main

    main(sys.argv[1:])
elif sys.argv[1:2] == ["moe"]:  # python -m lmlab.bench moe ...: ffn=moe vs the dense FFN at equal active FLOPs
    from lmlab.bench.moe import main

    main(sys.argv[2:])
else:
    from lmlab.bench.cli import main

    main()
