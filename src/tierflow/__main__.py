from tierflow.commands.cli import main

raise SystemExit(main())
