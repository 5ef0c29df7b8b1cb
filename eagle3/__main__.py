from eagle3.cli import main

raise SystemExit(main())
