from zerohop.cli import main

raise SystemExit(main())
