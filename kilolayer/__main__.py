from kilolayer.cli import main

raise SystemExit(main())
