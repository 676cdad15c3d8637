module github.com/erofs/go-erofs

go 1.23
