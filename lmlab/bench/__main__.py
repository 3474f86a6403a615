from lmlab.bench.cli import main

main()
