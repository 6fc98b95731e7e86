build/obj/gen/kvc.pb-c.o: build/gen/kvc.pb-c.c build/gen/kvc.pb-c.h
build/gen/kvc.pb-c.h:
