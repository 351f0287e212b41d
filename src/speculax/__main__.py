from ._cli._command import main


raise SystemExit(main())
