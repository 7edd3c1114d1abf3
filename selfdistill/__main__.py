from selfdistill.cli import main

raise SystemExit(main())
