from tierflow.commands.cli import main

if __name__ == "__main__":  # a spawn/forkserver worker imports this module: it must not run the CLI again
    raise SystemExit(main())
